"""axplug-eval: lm-eval tasks in process through the Engine, checked against a plain forward
pass and against lm-eval's own `local-completions` model talking to `axplug serve`."""

from __future__ import annotations

import json
import os
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

lm_eval = pytest.importorskip("lm_eval")
pytest.importorskip("axplug_serve")

from axplug_eval.command import evaluate  # noqa: E402
from axplug_eval.lm import EngineLM, cut_at_stops  # noqa: E402
from axplug_testing import cli_main as main  # noqa: E402

from axplug.api.config import UsageError  # noqa: E402
from axplug.api.layers import functional  # noqa: E402
from axplug.api.run import Engine, find_tokenizer, load_checkpoint  # noqa: E402
from axplug.api.summary import read_jsonl  # noqa: E402

MAX_LEN = 64
KEY = "eval-key"
# Short: each multiple-choice request (question, lm-eval's " " delimiter and choice) and the
# short text's rolling window fit 16 tokens, so the tasks score at one prefill width (16) in
# process and on the server (the long text's windows score at 64: the forward pass test's).
MC = [
    {"question": "HAMLET. To", "choices": [" be", " cat", " xq"], "answer": 0},
    {"question": "KING. My", "choices": [" lord", " zz"], "answer": 0},
    {"question": "ROMEO. O", "choices": [" Romeo", " qqq", " the"], "answer": 2},
    {"question": "First", "choices": [" Citizen", " Xylophone"], "answer": 0},
    {"question": "The", "choices": [" king", " qj"], "answer": 0},
]
GEN = [{"prompt": "HAMLET.", "target": " To be"}, {"prompt": "KING.\n", "target": " My"},
       {"prompt": "To be, or", "target": " not"}]  # fmt: skip
TEXTS = [{"text": "HAMLET. To be, or not to be, that is the question: " * 3},
         {"text": "Words, words."}]  # fmt: skip


@pytest.fixture(autouse=True)
def _offline(monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)  # --api-key may set it


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory, trained_run):
    from axplug_testing import copy_run

    llama_tiny = trained_run("llama-tiny", "input.seq_len=64")  # shared with other modules
    return str(copy_run(llama_tiny, tmp_path_factory.mktemp("evaluated") / "tiny"))


@pytest.fixture(scope="module")
def tasks(tmp_path_factory):
    """Three tiny local tasks, one per request type: no hub, no network."""
    root = tmp_path_factory.mktemp("tasks")
    for name, rows in (("mc", MC), ("gen", GEN), ("ppl", TEXTS)):
        (root / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    common = "dataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {}\ntest_split: test\n"
    (root / "mc.yaml").write_text(
        "task: tiny_mc\n" + common.format(root / "mc.jsonl") + "output_type: multiple_choice\n"
        'doc_to_text: "{{question}}"\ndoc_to_choice: "{{choices}}"\n'
        'doc_to_target: "{{answer}}"\nmetric_list:\n  - metric: acc\n'
        "    aggregation: mean\n    higher_is_better: true\n"
    )
    (root / "gen.yaml").write_text(
        "task: tiny_gen\n" + common.format(root / "gen.jsonl") + "output_type: generate_until\n"
        'doc_to_text: "{{prompt}}"\ndoc_to_target: "{{target}}"\ngeneration_kwargs:\n'
        '  until: [" "]\n  max_gen_toks: 8\n  do_sample: false\nmetric_list:\n'
        "  - metric: exact_match\n    aggregation: mean\n    higher_is_better: true\n"
    )
    (root / "ppl.yaml").write_text(
        "task: tiny_ppl\n" + common.format(root / "ppl.jsonl")
        + 'output_type: loglikelihood_rolling\ndoc_to_text: ""\ndoc_to_target: "{{text}}"\n'
        "metric_list:\n  - metric: word_perplexity\n  - metric: bits_per_byte\n"
    )  # fmt: skip
    return str(root)


@pytest.fixture(scope="module")
def engine_lm(run_dir):
    loaded = load_checkpoint(run_dir)
    tokenizer = find_tokenizer(loaded, run_dir)
    engine = Engine(loaded.model, loaded.params, num_slots=3, max_len=MAX_LEN)
    return loaded, EngineLM(engine, tokenizer, max_gen_toks=8, batch_size=5)


def _args(include, **extra):
    defaults = dict(tasks=["tiny_mc", "tiny_gen", "tiny_ppl"], include_path=[include], limit=None,
                    num_fewshot=None, batch_size=4, seed=1234, max_gen_toks=8, max_len=MAX_LEN,
                    base_url=None, model=None, api_key=None)  # fmt: skip
    return types.SimpleNamespace(**{**defaults, **extra})


def _forward_logprobs(loaded):
    """ids -> log-softmax of one plain forward pass (row t scores ids[t + 1]), compiled once:
    ids are zero-padded to MAX_LEN (causal: the padding is unseen)."""

    @jax.jit
    def forward(params, ids):
        logits, _ = functional(loaded.model, prng_key=None, state=params, inputs=(ids,),
                               is_training=False, method="predict")  # fmt: skip
        return jax.nn.log_softmax(logits[0].astype(jnp.float32), axis=-1)

    def logprobs(ids):
        padded = np.zeros((1, MAX_LEN), np.int32)
        padded[0, : len(ids)] = ids
        return np.asarray(forward(loaded.params, padded))[: len(ids)]

    return logprobs


def test_loglikelihoods_equal_a_plain_forward_pass(engine_lm):
    loaded, lm = engine_lm
    tokenizer, forward_logprobs = lm.tokenizer, _forward_logprobs(loaded)
    pairs = [("HAMLET. To be, or", " not to be"), ("KING.", " My lord"), ("x" * 80, " tail")]
    requests = [types.SimpleNamespace(args=pair) for pair in pairs]
    got = lm.loglikelihood(requests)
    for (context, continuation), (logprob, greedy) in zip(pairs, got, strict=True):
        ids = tokenizer.encode(context + continuation)[-MAX_LEN:]  # left-truncated as lm-eval
        start = len(ids) - len(tokenizer.encode(continuation))
        table = forward_logprobs(ids)
        want = [table[t - 1, ids[t]] for t in range(start, len(ids))]
        assert logprob == pytest.approx(sum(want), abs=1e-4)
        assert greedy == all(table[t - 1].argmax() == ids[t] for t in range(start, len(ids)))
    # Rolling: lm-eval's disjoint windows, each scored by a forward pass of its own.
    from lm_eval import utils as lm_utils

    text = TEXTS[0]["text"]
    (rolling,) = lm.loglikelihood_rolling([types.SimpleNamespace(args=(text,))])
    ids = tokenizer.encode(text)
    windows = list(map(lm_utils.make_disjoint_window, lm_utils.get_rolling_token_windows(
        ids, prefix_token=lm.prefix_token_id, max_seq_len=MAX_LEN - 1, context_len=1)))  # fmt: skip
    assert len(windows) > 1 and sum(len(c) for _, c in windows) == len(ids)
    total = 0.0
    for context, continuation in windows:
        window = (context + continuation)[-MAX_LEN:]
        table = forward_logprobs(window)
        total += sum(table[t - 1, window[t]] for t in range(len(window) - len(continuation),
                                                             len(window)))  # fmt: skip
    assert rolling == pytest.approx(total, abs=1e-3)


def test_generation_cuts_at_the_first_stop_string():
    assert cut_at_stops("abc\ndef END", ["END", "\n"]) == "abc"
    assert cut_at_stops("abc", ["", "z"]) == "abc"


@pytest.fixture(scope="module")
def server(run_dir, tmp_path_factory):
    """`axplug serve` of the same checkpoint, with an API key, on a thread of this process."""
    from axplug_serve.testing import serve_in_thread

    log = tmp_path_factory.mktemp("serve") / "server.log"
    options = ["--checkpoint", run_dir, "--num-slots", "2", "--max-queue", "2", "--max-len",
               str(MAX_LEN), "--api-key", KEY, "--log-level", "warning", "--no-warmup"]  # fmt: skip
    with serve_in_thread(options, log) as base:
        yield base


def _samples(results: dict) -> dict:
    """Per task, each document's responses in document order."""
    return {task: [s["resps"] for s in sorted(rows, key=lambda s: s["doc_id"])]
            for task, rows in results["samples"].items()}  # fmt: skip


def test_in_process_scores_equal_lm_evals_own_client_against_axplug_serve(engine_lm, server, tasks):
    _, lm = engine_lm
    args = _args(tasks)
    local = evaluate(lm, args, log_samples=True)
    # lm-eval's own OpenAI client, 4 prompts per request, the server's tokenizer endpoints.
    # Without an EOS (a byte tokenizer) lm-eval's API client cannot build rolling windows:
    # perplexity is compared with the forward pass above instead.
    remote_args = _args(tasks, tasks=["tiny_mc", "tiny_gen"], base_url=server + "/v1",
                        model="tiny", api_key=KEY)  # fmt: skip
    remote = evaluate("local-completions", remote_args, log_samples=True)
    mine, theirs = _samples(local), _samples(remote)
    for doc_mine, doc_theirs in zip(mine["tiny_mc"], theirs["tiny_mc"], strict=True):
        for (lp_mine, greedy_mine), (lp_theirs, greedy_theirs) in zip(
            [r[0] for r in doc_mine], [r[0] for r in doc_theirs], strict=True
        ):
            assert lp_mine == pytest.approx(lp_theirs, abs=1e-4)
            assert greedy_mine == greedy_theirs
    assert mine["tiny_gen"] == theirs["tiny_gen"]
    assert len(mine["tiny_gen"]) == len(GEN) and any(r[0][0] for r in mine["tiny_gen"])
    assert np.isfinite(local["results"]["tiny_ppl"]["word_perplexity,none"])
    assert "pretty_env_info" not in local  # lm-eval's environment report: not collected
    for task in ("tiny_mc", "tiny_gen"):
        for metric, value in local["results"][task].items():
            if "stderr" not in metric and metric not in ("alias", "name"):
                assert remote["results"][task][metric] == pytest.approx(value, abs=1e-6), metric


def test_the_eval_command_writes_results_and_records_them(run_dir, tasks, tmp_path, capsys):
    out = tmp_path / "results.json"
    argv = [
        "eval",
        "--checkpoint",
        run_dir,
        "--tasks",
        "tiny_mc",
        "--include-path",
        tasks,
        "--max-len",
        str(MAX_LEN),
        "--limit",
        "3",
        "--output",
        str(out),
        "--record",
    ]
    assert main(argv) == 0
    printed = capsys.readouterr()
    assert "tiny_mc" in printed.out and "acc" in printed.out
    result = json.loads(out.read_text())
    accuracy = result["metrics"]["eval/tiny_mc/acc"]
    assert 0 <= accuracy <= 1 and result["results"]["tiny_mc"]["sample_len"] == 3
    (record,) = read_jsonl(os.path.join(run_dir, "eval.jsonl"))
    # The shared llama-tiny run ends (and checkpoints) at step 2.
    assert record["step"] == result["step"] == 2 and record["eval/tiny_mc/acc"] == accuracy


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--tasks", "x"], "give --checkpoint (evaluate in process) or --base-url"),
        (["--tasks", "x", "--base-url", "http://127.0.0.1:1/v1"], "--base-url needs --model"),
        (
            ["--tasks", "x", "--checkpoint", "RUN", "--include-path", "/nonexistent"],
            "--include-path /nonexistent: no such directory",
        ),
        (["--tasks", "no_such_task", "--checkpoint", "RUN"], "no task named 'no_such_task'"),
        (["--tasks", "x", "--checkpoint", "RUN", "--batch-size", "0"], "--batch-size 0: must"),
    ],
)
def test_eval_errors_are_one_line(run_dir, argv, message, capsys):
    argv = [run_dir if a == "RUN" else a for a in argv]
    assert main(["eval", *argv]) == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and message in lines[0], err
    assert "Traceback" not in err


def test_a_task_name_no_task_file_mentions_is_refused_without_lm_evals_index(tasks, monkeypatch):
    """The built-in index parses ~14,000 task files (6-12 s); a name that no file mentions is
    unknown for certain, and one that a file mentions only in passing goes on to the index."""
    from axplug_eval import command

    index = lambda *args, **kwargs: pytest.fail("lm-eval's task index was built")  # noqa: E731
    monkeypatch.setattr(command, "task_index", index)
    assert command._mentioned_nowhere(("no_such_task", "tiny_mc"), (str(tasks),)) == [
        "no_such_task"
    ]
    # Mentioned in tiny_mc's file (a field, not a task): lm-eval's index decides.
    assert command._mentioned_nowhere(("test_split",), (str(tasks),)) == []
    with pytest.raises(UsageError, match="no task named 'no_such_task'"):
        command._index_for((), ["no_such_task"])


def test_eval_tasks_during_training_log_beside_the_loss(tasks, tmp_path, capsys, monkeypatch):
    """`--modifier eval_tasks:...` logs eval/TASK/METRIC every `every` steps; the last equals
    `axplug eval` of the final checkpoint. The include path's task files are indexed once (not
    lm-eval's built-in ones)."""
    import lm_eval.tasks
    from axplug_eval.command import task_index
    from axplug_testing import tiny_train_args

    built, original = [], lm_eval.tasks.TaskManager
    monkeypatch.setattr(
        lm_eval.tasks, "TaskManager", lambda **kw: built.append(kw) or original(**kw)
    )
    task_index.cache_clear()

    run = tmp_path / "run"
    modifier = f"eval_tasks:tasks=tiny_mc+tiny_gen,include_path={tasks},limit=3,every=2"
    argv = tiny_train_args(run, "input.seq_len=64", preset="llama-tiny", max_steps=4,
                           modifiers=[modifier])  # fmt: skip
    assert main(argv) == 0
    records = [r for r in read_jsonl(run / "metrics.jsonl") if "eval/tiny_mc/acc" in r]
    assert [r["step"] for r in records] == [2, 4]
    assert all("eval/tiny_gen/exact_match" in r for r in records)
    out = tmp_path / "final.json"
    assert main(["eval", "--checkpoint", str(run), "--tasks", "tiny_mc,tiny_gen",
                 "--include-path", tasks, "--limit", "3", "--max-len", "64",
                 "--max-gen-toks", "32", "--output", str(out)]) == 0  # fmt: skip
    final = json.loads(out.read_text())["metrics"]
    assert {k: records[-1][k] for k in final} == pytest.approx(final)
    # Three evaluations, one index of the include path alone.
    assert built == [{"include_path": [str(tasks)], "include_defaults": False}]
    capsys.readouterr()
    bad = tiny_train_args(run, preset="llama-tiny", modifiers=["eval_tasks:limit=3"])
    assert main([*bad, "--print-config"]) == 2
    assert "evaluators[0].tasks: name at least one lm-eval task" in capsys.readouterr().err


def _fake_server(answers_models: bool):
    """A server on 127.0.0.1 that lists a model, then fails every other request (one that
    died mid-evaluation, as lm-eval's client sees it); its URL and its stop function."""
    import http.server
    import threading

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - http.server's name
            ok = answers_models and self.path.endswith("/models")
            self.send_response(200 if ok else 500)
            self.end_headers()
            self.wfile.write(b'{"data": [{"id": "tiny"}]}' if ok else b"")

        do_POST = do_GET  # noqa: N815

        def log_message(self, *args):
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    return f"http://127.0.0.1:{httpd.server_address[1]}/v1", httpd.shutdown


def test_a_server_that_is_gone_or_fails_midway_is_one_line(tasks, tmp_path, capsys):
    import socket

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}/v1"
    failing, stop = _fake_server(answers_models=True)
    out = tmp_path / "results.json"
    try:
        for url, message in (
            (dead, "no server answers ("),
            (failing, "the server failed while evaluating tiny_mc ("),
        ):
            argv = ["eval", "--base-url", url, "--model", "tiny", "--tasks", "tiny_mc",
                    "--include-path", tasks, "--limit", "1", "--output", str(out)]  # fmt: skip
            assert main(argv) != 0
            err = capsys.readouterr().err
            lines = [line for line in err.splitlines() if line.startswith("error:")]
            assert len(lines) == 1 and lines[0].startswith(f"error: --base-url {url}: "), err
            assert message in lines[0] and "Traceback" not in err
            assert not out.exists()
    finally:
        stop()
