"""`axplug eval`: lm-evaluation-harness tasks against a checkpoint (in process, through the
Engine) or against any OpenAI-compatible server (`--base-url`)."""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
from pathlib import Path
from typing import Any

from axplug.api import add_checkpoint_arguments, add_command
from axplug.api.config import ConfigDependencyError

__all__ = ["add_parser", "run", "evaluate"]

EPILOG = """\
examples:
  axplug eval --checkpoint runs/llama --tasks hellaswag,arc_easy --limit 100
  axplug eval --checkpoint runs/demo --tasks my_task --include-path tasks/ --output out.json
  axplug eval --checkpoint runs/demo --tasks my_task --include-path tasks/ --record
  axplug eval --base-url http://127.0.0.1:8000/v1 --model demo --tasks my_task \\
      --include-path tasks/                    # the same tasks against a server

Tasks come from lm-eval's registry (its datasets are fetched from the Hugging Face hub, or
read from the local cache with HF_DATASETS_OFFLINE=1) or from YAML files in --include-path
(a task over local JSONL: `dataset_path: json` with `dataset_kwargs.data_files`). With
--checkpoint the model runs in this process through the continuous-batching engine:
loglikelihood and rolling-loglikelihood requests are one prefill each, scored from the
prompt's log-probabilities; generation tasks decode greedily unless the task samples. With
--base-url, lm-eval's `local-completions` model sends the same prompts to the server
(tokenized by its /tokenize, batched --batch-size prompts per request), so both give the
same scores for the same model. Results print as a table; --output writes them as JSON,
--record appends `eval/TASK/METRIC` at the checkpoint's step to RUN/eval.jsonl.
"""


def _tasks(text: str) -> list[str]:
    tasks = [t.strip() for t in text.split(",") if t.strip()]
    if not tasks:
        raise argparse.ArgumentTypeError("give at least one task name")
    return tasks


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    parser = add_command(
        subparsers,
        "eval",
        run,
        help="run lm-evaluation-harness tasks on a checkpoint or a server",
        description="Evaluate a checkpoint (in process) or an OpenAI-compatible server on "
        "lm-evaluation-harness tasks: multiple choice, perplexity and generation.",
        epilog=EPILOG,
    )
    add_checkpoint_arguments(parser, required=False)
    parser.add_argument("--tasks", type=_tasks, required=True, metavar="T1,T2,...")
    parser.add_argument(
        "--include-path", action="append", default=[], metavar="DIR",
        help="a directory of task YAML files (repeatable)",
    )  # fmt: skip
    parser.add_argument("--limit", type=float, help="documents per task (N, or a fraction < 1)")
    parser.add_argument("--num-fewshot", type=int, metavar="N", help="few-shot examples")
    parser.add_argument(
        "--batch-size", type=int, default=64, metavar="N",
        help="requests given to the engine at a time, or prompts per server request (64)",
    )  # fmt: skip
    parser.add_argument(
        "--num-slots", type=int, default=8, metavar="N", help="requests decoded at once (8)"
    )
    parser.add_argument(
        "--max-len", type=int, metavar="TOKENS", help="context per request (default: trained)"
    )
    parser.add_argument(
        "--speculative", metavar="PROPOSER",
        help="speculative decoding for generation tasks, same tokens (`ngram`, "
        "`draft:checkpoint=RUN`; see `axplug serve --help`)",
    )  # fmt: skip
    parser.add_argument(
        "--max-gen-toks", type=int, metavar="N",
        help="new tokens of a generation task that sets none (256, at most half the context)",
    )  # fmt: skip
    parser.add_argument("--seed", type=int, default=1234, help="lm-eval's seeds (1234)")
    parser.add_argument("--output", metavar="FILE.json", help="write the results as JSON")
    parser.add_argument(
        "--record", action="store_true",
        help="append the metrics at the checkpoint's step to RUN/eval.jsonl",
    )  # fmt: skip
    server = parser.add_argument_group("against a server instead of --checkpoint")
    server.add_argument("--base-url", metavar="URL", help="e.g. http://127.0.0.1:8000/v1")
    server.add_argument("--model", metavar="NAME", help="the server's model name")
    server.add_argument(
        "--api-key", metavar="KEY", help="the server's key (default: $OPENAI_API_KEY)"
    )
    return parser


def _check(args: argparse.Namespace) -> None:
    from axplug.api.config import UsageError

    if (args.checkpoint is None) == (args.base_url is None):
        raise UsageError("give --checkpoint (evaluate in process) or --base-url (a server)")
    if args.base_url is not None and not args.model:
        raise UsageError("--base-url needs --model (the name the server serves; GET /v1/models)")
    if args.record and args.checkpoint is None:
        raise UsageError("--record writes into a run directory: it needs --checkpoint")
    for option, value in (("--batch-size", args.batch_size), ("--num-slots", args.num_slots),
                          ("--max-gen-toks", args.max_gen_toks or 1)):  # fmt: skip
        if value < 1:
            raise UsageError(f"{option} {value}: must be at least 1")
    if args.limit is not None and args.limit <= 0:
        raise UsageError(f"--limit {args.limit}: must be > 0")
    for path in args.include_path:
        if not os.path.isdir(path):
            raise UsageError(f"--include-path {path}: no such directory")


def _engine_model(args: argparse.Namespace):
    """(EngineLM, checkpoint step) for --checkpoint."""
    from axplug.api.run import Engine, find_tokenizer, load_checkpoint
    from axplug_eval.lm import EngineLM

    loaded = load_checkpoint(args.checkpoint, step=args.step, modifiers=args.modifier,
                             merge_adapters=args.merge_adapters)  # fmt: skip
    tokenizer = find_tokenizer(loaded, args.checkpoint, args.tokenizer)
    trained = getattr(loaded.config.input, "seq_len", None)
    max_len = args.max_len or (trained if isinstance(trained, int) and trained > 1 else 2048)
    if args.max_gen_toks is None:
        args.max_gen_toks = min(256, max_len // 2)
    elif args.max_gen_toks >= max_len:
        from axplug.api.config import UsageError

        raise UsageError(f"--max-gen-toks {args.max_gen_toks}: must be below the context "
                         f"({max_len} tokens; --max-len)")  # fmt: skip
    engine = Engine(loaded.model, loaded.params, num_slots=args.num_slots, max_len=max_len,
                    mesh=loaded.mesh, axis_rules=loaded.axis_rules,
                    speculative=args.speculative)  # fmt: skip
    stop = loaded.stop_tokens or ((tokenizer.eos_id,) if tokenizer.eos_id is not None else ())

    def progress(done: int, total: int) -> None:
        print(f"axplug eval: {done}/{total} requests", file=sys.stderr, flush=True)

    model = EngineLM(engine, tokenizer, stop_tokens=stop, max_gen_toks=args.max_gen_toks,
                     batch_size=args.batch_size, progress=progress)  # fmt: skip
    return model, loaded.step


@functools.lru_cache(maxsize=8)
def task_index(include_path: tuple[str, ...], defaults: bool = True) -> Any:
    """lm-eval's TaskManager for `include_path` (and its built-in tasks unless `defaults` is
    False), built once per process: the built-in index reads thousands of task files (4-6 s),
    which an eval every N steps of a run would pay each time."""
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=list(include_path) or None, include_defaults=defaults)


def _index_for(include_path: tuple[str, ...], tasks: list[str]) -> Any:
    """The include path's own index when it defines every task asked for, else the index with
    lm-eval's built-in tasks too (a group of the include path may name built-in tasks)."""
    if include_path:
        own = task_index(include_path, defaults=False)
        if all(task in own.all_subtasks for task in tasks):
            return own
    unknown = _mentioned_nowhere(tuple(tasks), include_path)
    if unknown:
        _unknown_task(unknown[0])
    return task_index(include_path)


@functools.lru_cache(maxsize=8)
def _mentioned_nowhere(tasks: tuple[str, ...], include_path: tuple[str, ...]) -> list[str]:
    """The names in `tasks` that no task file (lm-eval's or `include_path`'s) mentions: unknown
    for certain, found from the files' bytes (0.6 s) before the index parses them (6-12 s)."""
    import lm_eval.tasks

    left = {task: task.encode() for task in tasks}
    for root in (Path(lm_eval.tasks.__file__).parent, *map(Path, include_path)):
        for path in root.rglob("*.yaml"):
            data = path.read_bytes()
            left = {task: name for task, name in left.items() if name not in data}
            if not left:
                return []
    return list(left)


def _unknown_task(task: str) -> None:
    from axplug.api.config import UsageError

    raise UsageError(f"--tasks: no task named {task!r} in lm-eval's registry or "
                     "--include-path; `lm-eval ls tasks` lists them")  # fmt: skip


def evaluate(model: Any, args: Any, *, log_samples: bool = False) -> dict[str, Any]:
    """lm-eval's `simple_evaluate` of `model` (an LM, or "local-completions" for a server)."""
    from unittest import mock

    import lm_eval
    import lm_eval.evaluator

    manager = _index_for(tuple(args.include_path), list(args.tasks))
    unknown = [t for t in args.tasks if t not in manager.all_tasks]
    if unknown:
        _unknown_task(unknown[0])
    model_args = None
    if isinstance(model, str):
        model_args = {
            "base_url": args.base_url.rstrip("/") + "/completions", "model": args.model,
            "tokenizer_backend": "remote", "tokenized_requests": True,
            "max_gen_toks": args.max_gen_toks or 256, "num_concurrent": 1, "max_retries": 1,
        }  # fmt: skip
        if args.max_len:
            model_args["max_length"] = args.max_len
        key = args.api_key or os.environ.get("OPENAI_API_KEY")
        if key:  # lm-eval's tokenizer client takes it as auth_token, its requests from the env
            model_args["auth_token"] = key
            os.environ["OPENAI_API_KEY"] = key
        _check_server(args.base_url, key)
    seeds = {"random_seed": args.seed, "numpy_random_seed": args.seed,
             "torch_random_seed": args.seed, "fewshot_random_seed": args.seed}  # fmt: skip
    # lm-eval's environment report (torch's: `pip list`, `nvidia-smi`, compilers; 12 child
    # processes, 0.3-6 CPU-s) is not part of what axplug writes: an eval every N steps of a run
    # would pay it each time.
    with mock.patch.object(lm_eval.evaluator, "add_env_info", lambda results: None):
        try:
            return lm_eval.simple_evaluate(
                model=model, model_args=model_args, tasks=args.tasks, task_manager=manager,
                num_fewshot=args.num_fewshot, limit=args.limit, batch_size=args.batch_size,
                log_samples=log_samples, **seeds,
            )  # fmt: skip
        except Exception as exc:
            if model_args is None:
                raise
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]
            raise ConfigDependencyError(
                f"--base-url {args.base_url}: the server failed while evaluating "
                f"{', '.join(args.tasks)} ({first}); no results were written: run it again "
                "once the server answers"
            ) from None


def _check_server(base_url: str, key: str | None) -> None:
    """One error line when nothing answers at `base_url` (lm-eval would raise from deep in
    its tokenizer client); any HTTP answer, even a refusal, means a server is there."""
    import urllib.error
    import urllib.request

    headers = {"Authorization": f"Bearer {key}"} if key else {}
    request = urllib.request.Request(base_url.rstrip("/") + "/models", headers=headers)
    try:
        urllib.request.urlopen(request, timeout=10).close()  # noqa: S310 - the user's URL
    except urllib.error.HTTPError:
        return
    except (urllib.error.URLError, OSError, ValueError) as exc:
        reason = exc.reason if isinstance(exc, urllib.error.URLError) else exc
        raise ConfigDependencyError(
            f"--base-url {base_url}: no server answers ({reason}); start one (`axplug serve "
            "RUN`) or fix the URL"
        ) from None


def metrics(results: dict[str, Any]) -> dict[str, float]:
    """`eval/TASK/METRIC` -> value of every numeric result (stderrs left out)."""
    out = {}
    for task, values in results["results"].items():
        for key, value in values.items():
            metric = key.partition(",")[0]
            numeric = isinstance(value, (int, float)) and not isinstance(value, bool)
            if numeric and not metric.endswith("_stderr") and metric != "sample_len":
                out[f"eval/{task}/{metric}"] = float(value)
    return out


def run(args: argparse.Namespace) -> int:
    from lm_eval.utils import make_table

    from axplug.api.checkpoint import write_text

    _check(args)
    if args.checkpoint is not None:
        model, step = _engine_model(args)
    else:
        model, step = "local-completions", None
    results = evaluate(model, args)
    print(make_table(results))
    scalars = metrics(results)
    if args.output:
        record = {"step": step, "metrics": scalars, "results": results["results"],
                  "config": {k: v for k, v in results.get("config", {}).items()
                             if isinstance(v, (str, int, float, bool, type(None)))}}  # fmt: skip
        write_text(args.output, json.dumps(record, indent=2, default=str) + "\n")
        print(f"axplug eval: results in {args.output}", file=sys.stderr)
    if args.record:
        from axplug.api.summary import JsonlWriter

        cfg = JsonlWriter.default_config().set(dir=args.checkpoint, filename="eval.jsonl")
        with cfg.instantiate() as writer:
            writer.write(step or 0, scalars)
        print(f"axplug eval: appended to {os.path.join(args.checkpoint, 'eval.jsonl')} "
              f"(step {step})", file=sys.stderr)  # fmt: skip
    return 0
