"""The `axplug` command run in this process: argv in, exit code and output out."""

from __future__ import annotations

import contextlib
import io
import logging
from typing import NamedTuple

__all__ = ["CliResult", "run_cli"]


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
