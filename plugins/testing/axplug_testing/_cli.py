"""The `axplug` command run in this process: argv in, exit code and output out."""

from __future__ import annotations

import argparse
import contextlib
import io
import logging
from collections.abc import Sequence
from typing import Any, NamedTuple

__all__ = ["CliResult", "cli_main", "command_parser", "run_cli", "train_config"]


class CliResult(NamedTuple):
    exit_code: int
    stdout: str
    stderr: str


def run_cli(*argv: str) -> CliResult:
    """`axplug ARGV...` through the real `main`, its stdout and stderr captured; the `axplug`
    logger is left as it was. A child process is needed only for signals, kills, several
    processes, or to show what a fresh interpreter imports."""
    from axplug.cli import main

    out, err = io.StringIO(), io.StringIO()
    logger = logging.getLogger("axplug")
    saved = (list(logger.handlers), logger.level, logger.propagate)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = main(list(argv))
            except SystemExit as exc:
                code = exc.code if isinstance(exc.code, int) else 1
    finally:
        logger.handlers[:], logger.level, logger.propagate = saved
    return CliResult(code, out.getvalue(), err.getvalue())


def cli_main(argv: Sequence[str]) -> int:
    """`axplug ARGV...` through the real `main`, its output left to the caller (capsys)."""
    from axplug.cli import main

    return main(list(argv))


def command_parser(argv: Sequence[str] | None = None) -> argparse.ArgumentParser:
    """The `axplug` command's own parser (with the plugin commands `argv` names): what a test
    of a command line another command renders parses it with."""
    from axplug.cli.main import build_parser

    return build_parser(None if argv is None else list(argv))


def train_config(argv: Sequence[str]) -> Any:
    """The Trainer config `axplug train ARGV...` would run, built as the command builds it."""
    from axplug.cli.train_cmd import build_config

    return build_config(command_parser().parse_args(["train", *argv]))
