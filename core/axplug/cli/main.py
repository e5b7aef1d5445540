"""`axplug` entry point: builds one subcommand per module listed in `COMMANDS` and runs it."""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Sequence

from axplug import __version__
from axplug.registry import DISABLE_ENV

__all__ = ["COMMANDS", "build_parser", "main"]

# Each module exposes `add_parser(subparsers)`, which sets `run(args) -> int` as the default.
# Command modules import nothing heavy at module level, so `axplug --help` stays fast.
COMMANDS = (
    "axplug.cli.list_cmd",
    "axplug.cli.info_cmd",
    "axplug.cli.train_cmd",
    "axplug.cli.metrics_cmd",
    "axplug.cli.checkpoints_cmd",
    "axplug.cli.aot_cmd",
    "axplug.cli.new_plugin_cmd",
    "axplug.cli.doctor_cmd",
    "axplug.cli.launch_cmd",
    "axplug.cli.generate_cmd",
    "axplug.cli.import_hf_cmd",
    "axplug.cli.export_hf_cmd",
    "axplug.cli.prepare_data_cmd",
)

EPILOG = """\
examples:
  axplug list                          every installed component and its status
  axplug list --kind layers --json     one kind, as JSON for scripts
  axplug info rms_norm                 where a component comes from, and its default config
  axplug --disable axplug-moe list     as if the axplug-moe plugin were not installed

environment:
  AXPLUG_DISABLE_PLUGINS=a,b    never load these plugin distributions
  AXPLUG_LOAD_PLUGINS=a,b       load only these (set but empty: the core alone)

run `axplug COMMAND --help` for the options of one command.
"""


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser with every command in `COMMANDS`."""
    parser = argparse.ArgumentParser(
        prog="axplug",
        description="A modular, plugin-based JAX framework for training and serving large models.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"axplug {__version__}")
    parser.add_argument(
        "--disable",
        metavar="DIST[,DIST]",
        action="append",
        default=[],
        help=f"skip these plugin distributions (added to ${DISABLE_ENV})",
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMANDS:
        importlib.import_module(name).add_parser(subparsers)
    return parser


def _exit_code(exc: BaseException) -> int | None:
    """2 for a bad setting, 1 for one of axplug's own failures, None for anything else."""
    from axplug.checkpoint import CheckpointError
    from axplug.config import ConfigError
    from axplug.registry import PluginLoadError
    from axplug.trainer.loop_state import NonFiniteError

    if isinstance(exc, ConfigError):
        return 2
    if isinstance(exc, CheckpointError | NonFiniteError | PluginLoadError):
        return 1
    return None


def main(argv: Sequence[str] | None = None) -> int:
    """Run `axplug` with `argv` (default: the process arguments); returns the exit code."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help, --version, usage errors: return the code, do not exit
        return exc.code if isinstance(exc.code, int) else 2
    if args.command is None:
        parser.print_help(sys.stderr)
        return 2
    saved = os.environ.get(DISABLE_ENV)
    if args.disable:
        os.environ[DISABLE_ENV] = ",".join(filter(None, [saved, *args.disable]))
    try:
        return args.run(args)
    except BrokenPipeError:
        # `axplug list | head`: the reader left. Quiet exit, and no second error at shutdown.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except Exception as exc:
        # One boundary for every command: axplug's own errors are one line (their messages
        # name the setting, step or plugin), exit 2 for a bad setting and 1 for a failed run;
        # AXPLUG_TRACEBACK=1 shows the traceback. Anything else is a bug: its traceback.
        code = _exit_code(exc)
        if code is None or os.environ.get("AXPLUG_TRACEBACK"):
            raise
        print(f"error: {exc}", file=sys.stderr)
        return code
    finally:
        # Restore, so an in-process caller (tests, notebooks) is not left with plugins disabled.
        if saved is None:
            os.environ.pop(DISABLE_ENV, None)
        else:
            os.environ[DISABLE_ENV] = saved
