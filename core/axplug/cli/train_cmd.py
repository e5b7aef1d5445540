"""`axplug train`: build a trainer from a preset, modifiers and overrides, then train or resume."""

from __future__ import annotations

import argparse
import faulthandler
import sys
from typing import Any

from axplug.api import add_command
from axplug.api._commands import add_config_arguments
from axplug.cli._train_config import base_config, build_config, source_label
from axplug.config import UsageError

__all__ = ["add_parser", "run", "build_config"]

# The names of axplug.runtime.CLUSTERS, repeated so `--help` imports no jax.
CLUSTER_NAMES = ("slurm", "ompi", "k8s", "gke-tpu", "tpu-vm", "mpi4py")

EPILOG = """\
examples:
  axplug train --preset gpt-tiny --output-dir runs/tiny
      train the tiny LLaMA on the bundled corpus; rerun the same command to resume
  axplug train --preset gpt-tiny --output-dir runs/gpt --max-steps 50 \
      --set learner.learning_rate=1e-3
  axplug train --preset gpt-tiny --modifier mesh:fsdp=-1 --output-dir runs/fsdp
      FSDP over every device (with XLA_FLAGS=--xla_force_host_platform_device_count=8 on CPU)
  axplug train --preset gpt-tiny --modifier scan_layers:remat_policy=full --output-dir runs/scan
  axplug train --preset gpt-tiny --input token_file:path=data/mine --output-dir runs/mine
      train on data tokenized by `axplug prepare-data` (docs/your-data.md)
  axplug train --from runs/imported --input token_file:path=data/mine --output-dir runs/ft
      fine-tune an `axplug import-hf` run (docs/fine-tuning.md)
  axplug train --config runs/mine/config.json --output-dir runs/again
  axplug train --preset gpt-tiny --config exp.yaml --output-dir runs/exp
      an experiment file of the fields to change (docs/configs.md); --print-config --diff
      shows what it changes
  axplug train --preset my_recipes:small --output-dir runs/mine    your own recipe function
  axplug train --preset recipes/small.py:small --output-dir runs/mine      ... from a file
  axplug train --preset gpt-tiny --output-dir runs/tiny --writer NAME:project=tiny
      also send metrics to an installed writer (axplug list --kind summary_writers)
  axplug train --preset gpt-tiny --modifier mesh:fsdp=-1 --output-dir /shared/run \\
      --coordinator 10.0.0.1:1234 --num-processes 2 --process-id 0
      one of two processes (run the same command with --process-id 1 on the other host)

The effective config is written to OUTPUT_DIR/config.txt before training; metrics go to
OUTPUT_DIR/metrics.jsonl and to each --writer (dashboards such as TensorBoard are plugins'
writers: axplug list --kind summary_writers), checkpoints to OUTPUT_DIR/checkpoints/; a
metrics plugin's command plots them.
A run pointed at an output dir with checkpoints resumes from the latest complete one.
At the end the run prints its goodput: wall time split into compile, data wait, step,
checkpoint, restore and other (also appended to OUTPUT_DIR/goodput.jsonl).

multi-process: --coordinator, --num-processes and --process-id may instead come from
JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES and JAX_PROCESS_ID, or from a scheduler JAX
detects (Slurm srun, Open MPI, GKE TPU; --cluster tpu-vm on Cloud TPU VMs). Every process
runs the same command with the same --output-dir on a shared filesystem or bucket.
See docs/launch.md and `axplug launch --print slurm|k8s|tpu-vm`.

SIGTERM or Ctrl-C stops after the step in flight: every process saves that step and the run
exits 75; a second signal exits at once, without saving.

exit codes: 0 done; 1 a failed run; 2 bad config or flags; 75 stopped with the state safe,
rerun the same command to resume: preempted (SIGTERM/SIGINT, saved), hung (with
--set watchdog.exit_on_hang=True), or a lost peer process (multi-process).
"""


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    parser = add_command(
        subparsers,
        "train",
        run,
        help="train a model from a preset (resumes from OUTPUT_DIR)",
        description="Train a model. The config is the preset's (with its own modifiers), a\n"
        "run's (--from, to fine-tune its weights) or a file's (--config); then the mesh rule's\n"
        "modifiers, each --modifier in order, --input, each --writer, each --set override.",
        epilog=EPILOG,
    )
    source = parser.add_mutually_exclusive_group()
    source.add_argument(
        "--preset",
        help="preset name (see `axplug list --kind presets`), or your recipe as "
        "module:function or path/to/file.py:function, a function of no arguments returning "
        "a Preset or a Trainer config",
    )
    source.add_argument(
        "--from",
        dest="from_run",
        metavar="RUN_DIR",
        help="fine-tune: the config and weights of a run (or `axplug import-hf` output); "
        "--set/--modifier/--input still apply; a new --output-dir",
    )
    parser.add_argument(
        "--config",
        metavar="FILE",
        help="a YAML, TOML or JSON file: the fields to change over --preset/--from (or its own "
        "'preset: NAME'), with 'modifiers' and 'input' keys; or a whole config (a run's "
        "config.json) on its own",
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
    add_config_arguments(parser)
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
        help="also send metrics to a registered summary writer, NAME:key=value,... (see "
        "`axplug list --kind summary_writers`); repeatable",
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
    # `--profile S` is `--set profile.steps=S`, in its place among the --set overrides.
    parser.add_argument(
        "--profile",
        action="append",
        dest="overrides",
        type=lambda steps: f"profile.steps={steps!r}",
        metavar="A:B|N",
        help="write a jax.profiler trace of steps A to B-1 (as numbered in metrics.jsonl; "
        "N: step N alone) to OUTPUT_DIR/profile, for `tensorboard --logdir OUTPUT_DIR/profile` "
        "(pip install xprof) or ui.perfetto.dev; the first step compiles: start at 2 or later",
    )
    group = parser.add_argument_group("multi-process (one process per host, all the same command)")
    group.add_argument("--coordinator", metavar="HOST:PORT", help="address of process 0")
    group.add_argument("--num-processes", type=int, metavar="N", help="processes in the job")
    group.add_argument("--process-id", type=int, metavar="I", help="this process, 0..N-1")
    group.add_argument(
        "--peer-timeout",
        type=float,
        default=None,
        metavar="SECONDS",
        help="a process whose heartbeat stops this long is lost: every other process exits 75 "
        "naming it (default 30; the coordination service's own timeout is set longer)",
    )
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
        help="print the effective config and exit without training (refusing what the "
        "run would refuse: an unknown optimizer, a bad writer setting)",
    )
    parser.add_argument(
        "--diff",
        action="store_true",
        help="with --print-config: only the fields that differ from the preset (or --from run)",
    )
    return parser


def config_diff(base, cfg) -> str:
    """`path: base value -> value` for each leaf field `cfg` changed, added or removed."""

    def leaves(c):
        return dict(line.split(": ", 1) for line in c.debug_string().splitlines())

    old, new = leaves(base), leaves(cfg)
    lines = []
    for path in sorted(old.keys() | new.keys()):
        if old.get(path) != new.get(path):
            lines.append(f"{path}: {old.get(path, '(absent)')} -> {new.get(path, '(absent)')}")
    return "\n".join(lines) if lines else "(no field differs from the base config)"


def run(args: argparse.Namespace) -> int:
    if args.output_dir is None and not args.print_config:
        raise UsageError("--output-dir is required (only --print-config does without)")
    if not args.print_config:
        # Before anything touches a device: the mesh rule is chosen from all processes' devices.
        start_processes(args)
    if args.diff and not args.print_config:
        raise UsageError("--diff goes with --print-config")
    cfg = build_config(args)
    if args.print_config:
        print(config_diff(base_config(args)[0], cfg) if args.diff else cfg.debug_string())
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
    from axplug.runtime import Preempted, StopSignals, await_lost_peer, stop_peer_monitor

    try:
        with StopSignals():
            metrics = train(
                cfg, provenance=provenance, allow_config_change=args.allow_config_change
            )
    except Preempted as stop:
        print(stop, file=sys.stderr)
        return stop.exit_code
    except Exception as exc:
        await_lost_peer(exc)  # a lost peer is named (exit 75), not a collective's error
        raise
    finally:
        stop_peer_monitor()
    loss = f", loss {metrics['loss']:.4f}" if "loss" in metrics else ""
    print(f"done: step {metrics.get('step')}{loss}")
    if "goodput/wall_s" in metrics:
        print(format_goodput(metrics))
    return 0


def start_processes(args: argparse.Namespace) -> None:
    """Initializes jax.distributed when flags, environment or a scheduler ask for processes."""
    from axplug.runtime import (
        DEFAULT_PEER_TIMEOUT_S,
        initialize_distributed,
        resolve_distributed,
        start_peer_monitor,
    )

    spec = resolve_distributed(
        args.coordinator, args.num_processes, args.process_id, cluster=args.cluster
    )
    timeout = DEFAULT_PEER_TIMEOUT_S if args.peer_timeout is None else args.peer_timeout
    if timeout <= 0:
        raise UsageError(f"--peer-timeout must be > 0 seconds, got {timeout:g}")
    if spec is None:
        return
    from axplug.cli._logging import configure_logging

    configure_logging(args.verbose - args.quiet)
    # An abort from the runtime's C++ (a backstop of the lost-peer check) prints every thread's
    # Python stack, so what aborted first is on record.
    faulthandler.enable(all_threads=True)
    index, count = initialize_distributed(spec, peer_timeout_s=timeout)
    print(f"process {index} of {count}", file=sys.stderr)
    start_peer_monitor(timeout)
