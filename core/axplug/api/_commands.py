"""What commands share: their parser's skeleton, and the options of commands that build a
config or load a model from a run."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

__all__ = ["add_command", "add_checkpoint_arguments", "add_config_arguments"]


def add_command(
    subparsers: Any, name: str, run: Callable, *, help: str, description: str, epilog: str
) -> argparse.ArgumentParser:
    """The parser of `axplug NAME`: a one-line `help`, a `description`, an `epilog` of examples
    kept as written; `axplug NAME ...` calls `run(args)`, whose int is the exit status."""
    parser = subparsers.add_parser(
        name,
        help=help,
        description=description,
        epilog=epilog,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.set_defaults(run=run)
    return parser


def add_checkpoint_arguments(parser: argparse.ArgumentParser, *, required: bool = True) -> None:
    """--checkpoint (`required` or not), --step, --tokenizer, --modifier and
    --merge-adapters, as `load_checkpoint` and `find_tokenizer` take them."""
    parser.add_argument("--checkpoint", required=required, metavar="DIR", help="run directory")
    parser.add_argument("--step", type=int, help="checkpoint step (default: the latest)")
    parser.add_argument(
        "--tokenizer",
        metavar="PATH",
        help="tokenizer file or directory, or `bytes` (default: the run's own)",
    )
    add_config_arguments(
        parser,
        modifier_help="apply to the loaded config, e.g. paged_kv_cache (repeatable)",
        overrides=False,
    )
    parser.add_argument(
        "--merge-adapters",
        action="store_true",
        help="fold adapters (LoRA) into their weights before running: no adapter matmuls",
    )


def add_config_arguments(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup,
    *,
    modifier_help: str = "apply a registered modifier; repeatable",
    overrides: bool = True,
) -> None:
    """--modifier NAME[:k=v,...] (into `args.modifier`) and, with `overrides`, --set
    PATH=VALUE (into `args.overrides`), each repeatable: the config edits of every command that
    builds a config, applied in that order."""
    parser.add_argument(
        "--modifier", action="append", default=[], metavar="NAME[:k=v,...]", help=modifier_help
    )
    if overrides:
        parser.add_argument(
            "--set",
            action="append",
            default=[],
            dest="overrides",
            metavar="PATH=VALUE",
            help="override one config field; repeatable",
        )
