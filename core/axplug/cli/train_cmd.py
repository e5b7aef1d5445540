"""`axplug train`: build a trainer from a preset, modifiers and overrides, then train or resume."""

from __future__ import annotations

import argparse
import sys
from typing import Any

__all__ = ["add_parser", "run", "build_config"]

# The names of axplug.runtime.CLUSTERS, repeated so `--help` imports no jax.
CLUSTER_NAMES = ("slurm", "ompi", "k8s", "gke-tpu", "tpu-vm", "mpi4py")

EPILOG = """\
examples:
  axplug train --preset llama-tiny --output-dir runs/tiny
      train the tiny LLaMA on the bundled corpus; rerun the same command to resume
  axplug train --preset gpt-tiny --output-dir runs/gpt --max-steps 50 \
      --set learner.learning_rate=1e-3
  axplug train --preset llama-tiny --modifier mesh:fsdp=-1 --output-dir runs/fsdp
      FSDP over every device (with XLA_FLAGS=--xla_force_host_platform_device_count=8 on CPU)
  axplug train --preset llama-tiny --modifier scan_layers:remat_policy=full --output-dir runs/scan
  axplug train --preset llama-tiny --input token_file:path=data/mine --output-dir runs/mine
      train on data tokenized by `axplug prepare-data` (docs/your-data.md)
  axplug train --from runs/imported --input token_file:path=data/mine --output-dir runs/ft
      fine-tune an `axplug import-hf` run (docs/fine-tuning.md)
  axplug train --config runs/mine/config.json --output-dir runs/again
  axplug train --preset my_recipes:small --output-dir runs/mine    your own recipe function
  axplug train --preset llama-tiny --output-dir runs/tiny --writer wandb:project=tiny
      also log to Weights & Biases (pip install axplug-wandb; axplug-mlflow for MLflow)
  axplug train --preset llama-tiny --modifier mesh:fsdp=-1 --output-dir /shared/run \\
      --coordinator 10.0.0.1:1234 --num-processes 2 --process-id 0
      one of two processes (run the same command with --process-id 1 on the other host)

The effective config is written to OUTPUT_DIR/config.txt before training; metrics go to
OUTPUT_DIR/metrics.jsonl and OUTPUT_DIR/tensorboard/ (and to each --writer), checkpoints to
OUTPUT_DIR/checkpoints/; `axplug metrics OUTPUT_DIR` plots them in the terminal.
A run pointed at an output dir with checkpoints resumes from the latest complete one.
At the end the run prints its goodput: wall time split into compile, data wait, step,
checkpoint, restore and other (also appended to OUTPUT_DIR/goodput.jsonl).

multi-process: --coordinator, --num-processes and --process-id may instead come from
JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES and JAX_PROCESS_ID, or from a scheduler JAX
detects (Slurm srun, Open MPI, GKE TPU; --cluster tpu-vm on Cloud TPU VMs). Every process
runs the same command with the same --output-dir on a shared filesystem or bucket.
See docs/launch.md and `axplug launch --print slurm|k8s|tpu-vm`.

exit codes: 0 done, 2 bad config or flags, 75 hung and stopped by the watchdog
(with --set watchdog.exit_on_hang=True): restart the same command to resume.
"""


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "train",
        help="train a model from a preset (resumes from OUTPUT_DIR)",
        description="Train a model. The config is the preset's (with its own modifiers), a\n"
        "run's (--from, to fine-tune its weights) or a file's (--config); then the mesh rule's\n"
        "modifiers, each --modifier in order, --input, each --writer, each --set override.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument(
        "--preset",
        help="preset name (see `axplug list --kind presets`), or your recipe as "
        "module:function returning a Preset or a Trainer config",
    )
    source.add_argument(
        "--from",
        dest="from_run",
        metavar="RUN_DIR",
        help="fine-tune: the config and weights of a run (or `axplug import-hf` output); "
        "--set/--modifier/--input still apply; a new --output-dir",
    )
    source.add_argument(
        "--config", metavar="FILE", help="a config file (config.json of a run, or to_dict JSON)"
    )
    parser.add_argument("--step", type=int, help="with --from: that step (default: the latest)")
    parser.add_argument(
        "--resume-optimizer",
        action="store_true",
        help="with --from: keep the run's optimizer state (default: fresh)",
    )
    parser.add_argument(
        "--trust-config",
        action="store_true",
        help="with --config: allow code outside axplug and its installed plugins",
    )
    parser.add_argument(
        "--modifier",
        action="append",
        default=[],
        metavar="NAME[:k=v,...]",
        help="apply a registered modifier; repeatable",
    )
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        dest="overrides",
        metavar="PATH=VALUE",
        help="override one config field; repeatable",
    )
    parser.add_argument(
        "--input",
        metavar="NAME[:k=v,...]",
        help="train on a registered input instead of the preset's, e.g. "
        "token_file:path=DATA_DIR (from `axplug prepare-data`); seq_len, batch_size and seed "
        "carry over unless given; the model's vocab is sized from the data's tokenizer",
    )
    parser.add_argument(
        "--allow-config-change",
        action="store_true",
        help="resume although the model config differs from the checkpoint's",
    )
    parser.add_argument(
        "--allow-vocab-mismatch",
        action="store_true",
        help="train although the model's vocab differs from the data's (e.g. bytes into a "
        "32000-token model)",
    )
    parser.add_argument(
        "--writer",
        action="append",
        default=[],
        metavar="NAME[:k=v,...]",
        help="also send metrics to a registered summary writer, e.g. wandb:project=demo or "
        "mlflow:experiment=demo (see `axplug list --kind summary_writers`); repeatable",
    )
    parser.add_argument(
        "--mesh-rule",
        default="auto",
        metavar="auto|SELECTOR",
        help="mesh rule: auto-detect the accelerator, a selector such as "
        "tpu-v5p-512, or 'none' (default: auto)",
    )
    parser.add_argument(
        "--output-dir",
        default=None,
        help="where config, metrics and checkpoints go (required unless --print-config)",
    )
    parser.add_argument("--max-steps", type=int, help="train until this many steps in total")
    parser.add_argument(
        "-v", "--verbose", action="count", default=0, help="more log detail (DEBUG)"
    )
    parser.add_argument(
        "-q", "--quiet", action="count", default=0, help="fewer logs: -q warnings, -qq errors"
    )
    parser.add_argument("--checkpoint-every", type=int, help="save every N steps")
    parser.add_argument("--seed", type=int, help="seed of initialization, data and dropout")
    group = parser.add_argument_group("multi-process (one process per host, all the same command)")
    group.add_argument("--coordinator", metavar="HOST:PORT", help="address of process 0")
    group.add_argument("--num-processes", type=int, metavar="N", help="processes in the job")
    group.add_argument("--process-id", type=int, metavar="I", help="this process, 0..N-1")
    group.add_argument(
        "--cluster",
        default="auto",
        choices=("auto", "none", *CLUSTER_NAMES),
        help="where the settings come from when not given: auto-detect a scheduler "
        "(default), none, or a named one (tpu-vm asks the TPU metadata server)",
    )
    parser.add_argument(
        "--print-config",
        action="store_true",
        help="print the effective config and exit without training",
    )
    parser.set_defaults(run=run)
    return parser


def build_config(args: argparse.Namespace):
    """The effective Trainer config for the parsed arguments."""
    from axplug.component_spec import component_config
    from axplug.config import ConfigError, apply_overrides
    from axplug.mesh_rules import select_mesh_rule
    from axplug.modifiers import make_modifier
    from axplug.presets import preset_config

    overrides = [] if args.output_dir is None else [f"output_dir={args.output_dir!r}"]
    for flag, field in (
        ("max_steps", "max_steps"),
        ("checkpoint_every", "checkpoint_every"),
        ("seed", "seed"),
    ):
        if getattr(args, flag) is not None:
            overrides.append(f"{field}={getattr(args, flag)}")
    if (args.step is not None or args.resume_optimizer) and args.from_run is None:
        raise ConfigError("--step and --resume-optimizer go with --from RUN_DIR")
    if args.from_run is not None:
        cfg = apply_overrides(run_config(args.from_run, args.step), overrides)
        cfg = cfg.clone(
            init_from=args.from_run, init_step=args.step, init_optimizer=args.resume_optimizer
        )
    elif args.config is not None:
        cfg = apply_overrides(config_file(args.config, trusted=args.trust_config), overrides)
    else:
        cfg = preset_config(args.preset, overrides=overrides)
    if args.mesh_rule != "none":
        name, rule = select_mesh_rule(args.mesh_rule)
        cfg = rule.modifier()(cfg)
        print(f"mesh rule: {name}", file=sys.stderr)
    for spec in args.modifier:
        cfg = make_modifier(spec)(cfg)
    if args.input is not None:
        cfg = with_input(cfg, args.input)
    if args.writer:
        writers = [component_config("summary_writers", spec, "writer") for spec in args.writer]
        cfg.summary_writers = [*cfg.summary_writers, *writers]
    if args.seed is not None:
        cfg.input.seed = args.seed
    if cfg.eval_input is None and any(o.strip().startswith("eval_input.") for o in args.overrides):
        cfg.eval_input = eval_input_for(cfg.input)  # `--set eval_input.x=...` edits this one
    cfg = apply_overrides(cfg, args.overrides)
    check_vocab(cfg, allow_mismatch=args.allow_vocab_mismatch, source=source_label(args))
    return cfg


def source_label(args: argparse.Namespace) -> str:
    """How the command line named the base config, for messages and provenance."""
    if args.from_run is not None:
        return f"--from {args.from_run}"
    if args.config is not None:
        return f"--config {args.config}"
    return f"--preset {args.preset}"


def run_config(run_dir: str, step: int | None):
    """The trainer config saved with a run's checkpoint (its latest, or `step`)."""
    from axplug.checkpoint import Checkpointer
    from axplug.config import from_dict
    from axplug.inference.loading import checkpoint_directory

    directory = checkpoint_directory(run_dir)
    with Checkpointer.default_config().set(directory=directory).instantiate() as checkpointer:
        metadata = checkpointer.metadata(step)
    if "config" not in metadata:
        from axplug.config import ConfigError

        raise ConfigError(f"--from {run_dir}: its checkpoint metadata holds no trainer config")
    return from_dict(metadata["config"])


def config_file(path: str, *, trusted: bool):
    """A Trainer config from a JSON (or YAML) file of `to_dict` form, or a run's config.json."""
    import json
    import pathlib

    from axplug.config import ConfigError, ConfigFileError, from_dict

    file = pathlib.Path(path)
    if not file.is_file():
        raise ConfigFileError(f"--config: {path!r} does not exist")
    text = file.read_text(encoding="utf-8")
    if file.suffix in (".yaml", ".yml"):
        try:
            import yaml
        except ImportError:
            raise ConfigError(f"--config {path}: YAML needs PyYAML: pip install pyyaml") from None
        data = yaml.safe_load(text)
    else:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise ConfigError(f"--config {path}: not JSON ({e})") from None
    if isinstance(data, dict) and "config" in data and "provenance" in data:
        data = data["config"]  # a run's config.json
    return from_dict(data, trusted=trusted)


# What a run's shape is made of: kept from the preset's input unless the --input spec sets it.
_CARRIED_INPUT_FIELDS = ("seq_len", "batch_size", "seed")


def with_input(cfg, spec: str):
    """`cfg` training on the input `spec`: fields the spec leaves out (seq_len, batch_size,
    seed...) carry over from the preset's input; the model's vocab becomes the data's."""
    from axplug.component_spec import component_config, parse_spec
    from axplug.config import REQUIRED, ConfigError
    from axplug.input import data_vocab_size

    _, given = parse_spec(spec, "input")
    new = component_config("inputs", spec, "input")
    missing = [k for k, v in new.items() if v is REQUIRED]
    if missing:
        raise ConfigError(
            f"--input {spec!r}: give {', '.join(f'{k}=...' for k in missing)} "
            f"(e.g. --input {spec.split(':')[0]}:{missing[0]}=VALUE)"
        )
    for key in _CARRIED_INPUT_FIELDS:
        if key not in given and hasattr(new, key) and hasattr(cfg.input, key):
            setattr(new, key, getattr(cfg.input, key))
    cfg = cfg.clone(input=new, eval_input=None)
    vocab = data_vocab_size(new)
    decoder = getattr(cfg.model, "decoder", None)
    if vocab is not None and getattr(decoder, "vocab_size", None) not in (None, vocab):
        print(f"model vocab: {vocab} (the data's tokenizer; was {decoder.vocab_size})",
              file=sys.stderr)  # fmt: skip
        decoder.vocab_size = vocab
    return cfg


def eval_input_for(input_cfg):
    """The held-out split of an input that has one, else None."""
    return input_cfg.clone(split="eval") if hasattr(input_cfg, "split") else None


def check_vocab(cfg, *, allow_mismatch: bool, source: str) -> None:
    """Refuses a model whose vocab cannot hold the data's ids, and (unless allowed) a large
    model vocab trained on bytes."""
    from axplug.config import ConfigError
    from axplug.input import data_vocab_size

    decoder = getattr(cfg.model, "decoder", None)
    model = getattr(decoder, "vocab_size", None)
    data = data_vocab_size(cfg.input)
    if not isinstance(model, int) or data is None or model == data:
        return
    if model < data:
        raise ConfigError(
            f"model.decoder.vocab_size: {model} is smaller than the data's vocabulary {data}; "
            f"token ids up to {data - 1} would index past the embedding. Set it to >= {data}"
        )
    if data == 256 and not allow_mismatch:
        raise ConfigError(
            f"{source} has a {model}-token vocabulary but its input is bytes "
            "(vocab 256): tokenize your data with `axplug prepare-data FILES --tokenizer PATH "
            "--output DIR` and pass --input token_file:path=DIR, or give "
            "--allow-vocab-mismatch to train on bytes anyway"
        )


def run(args: argparse.Namespace) -> int:
    from axplug.registry import ComponentNotFoundError

    if args.output_dir is None and not args.print_config:
        print("error: --output-dir is required (only --print-config does without)", file=sys.stderr)
        return 2
    if not args.print_config:
        # Before anything touches a device: the mesh rule is chosen from all processes' devices.
        try:
            start_processes(args)
        except ValueError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
    try:
        cfg = build_config(args)
    except ComponentNotFoundError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.print_config:
        print(cfg.debug_string())
        return 0
    from axplug.cli._logging import configure_logging
    from axplug.runtime import format_goodput

    configure_logging(args.verbose - args.quiet)
    from axplug.trainer.run import train

    # A bad setting, a failed save, a non-finite run: one line from the CLI's one boundary.
    provenance = {
        "argv": sys.argv,
        "source": source_label(args),
        "modifiers": args.modifier,
        "input": args.input,
        "writers": args.writer,
        "overrides": args.overrides,
    }
    metrics = train(cfg, provenance=provenance, allow_config_change=args.allow_config_change)
    loss = f", loss {metrics['loss']:.4f}" if "loss" in metrics else ""
    print(f"done: step {metrics.get('step')}{loss}")
    if "goodput/wall_s" in metrics:
        print(format_goodput(metrics))
    return 0


def start_processes(args: argparse.Namespace) -> None:
    """Initializes jax.distributed when flags, environment or a scheduler ask for processes."""
    from axplug.runtime import initialize_distributed, resolve_distributed

    spec = resolve_distributed(
        args.coordinator, args.num_processes, args.process_id, cluster=args.cluster
    )
    if spec is None:
        return
    from axplug.cli._logging import configure_logging

    configure_logging(args.verbose - args.quiet)
    index, count = initialize_distributed(spec)
    print(f"process {index} of {count}", file=sys.stderr)
