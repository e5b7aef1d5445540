"""`axplug` entry point: builds one subcommand per module listed in `COMMANDS` and runs it."""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

from axplug import __version__
from axplug.registry import DISABLE_ENV

__all__ = ["COMMANDS", "TRACEBACK_ENV", "build_parser", "main", "run_reporting_errors"]

TRACEBACK_ENV = "AXPLUG_TRACEBACK"  # set (to anything): an error shows its traceback too

# Each module exposes `add_parser(subparsers)`, which sets `run(args) -> int` as the default.
# Command modules import nothing heavy at module level, so `axplug --help` stays fast. The
# core's commands are imported from this tuple (no metadata scan); plugins add theirs through
# the `axplug.commands` entry-point group (name = the command, value = its module).
COMMANDS = (
    "axplug.cli.list_cmd",
    "axplug.cli.info_cmd",
    "axplug.cli.train_cmd",
    "axplug.cli.checkpoints_cmd",
    "axplug.cli.doctor_cmd",
    "axplug.cli.generate_cmd",
    "axplug.cli.import_hf_cmd",
    "axplug.cli.export_hf_cmd",
    "axplug.cli.prepare_data_cmd",
    "axplug.cli.data_cmd",
)

EPILOG = """\
examples:
  axplug list                          every installed component and its status
  axplug list --kind layers --json     one kind, as JSON for scripts
  axplug info rms_norm                 where a component comes from, and its default config
  axplug --disable DIST list           as if the plugin distribution DIST were not installed

environment:
  AXPLUG_DISABLE_PLUGINS=a,b    never load these plugin distributions
  AXPLUG_LOAD_PLUGINS=a,b       load only these (set but empty: the core alone)
  AXPLUG_TRACEBACK=1            show the traceback of an error, not just its `error:` line

run `axplug COMMAND --help` for the options of one command. Plugins add commands;
`axplug list --kind commands` lists them all.
"""


def build_parser(argv: Sequence[str] | None = None) -> argparse.ArgumentParser:
    """The top-level parser: the core's `COMMANDS`, and the plugins' `axplug.commands`.

    Only the plugin command named in `argv` is imported; the others are listed in `--help`
    with the first sentence of their module's docstring, read without importing them.
    """
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
    word = _command_word(parser, argv)
    if word not in subparsers.choices:  # a plugin's command, `--help`, or a typo
        _add_plugin_commands(subparsers, word)
    return parser


def _command_word(parser: argparse.ArgumentParser, argv: Sequence[str] | None) -> str | None:
    """The command named in `argv` (its first positional word), without parsing the rest."""
    args = list(sys.argv[1:] if argv is None else argv)
    takes_value = {o for a in parser._actions if a.nargs != 0 for o in a.option_strings}
    i = 0
    while i < len(args):
        word = args[i]
        if word == "--":
            return args[i + 1] if i + 1 < len(args) else None
        if not word.startswith("-"):
            return word
        i += 2 if word in takes_value else 1
    return None


def _add_plugin_commands(subparsers: Any, invoked: str | None) -> None:
    """The invoked plugin command with its real parser; the others as one-line entries."""
    from axplug import registry
    from axplug.registry import PluginLoadError

    core = set(subparsers.choices)
    components = [
        c
        for c in registry.discover("commands")
        if c.loadable and c.name not in core and c.status != "conflict"
    ]
    for c in components:
        if c.name != invoked:
            continue
        module = registry.load("commands", c.name)  # checked: it has add_parser
        module.add_parser(subparsers)
        if c.name not in subparsers.choices:
            raise PluginLoadError(
                f"{c.describe()}: add_parser() did not add a command named {c.name!r}; the "
                "entry-point name and the command name must agree",
                c,
            )
        return
    descriptions = registry.describe(components)
    for c in components:
        help_text = descriptions[c] or f"from {c.distribution}"
        # "`axplug serve`: an OpenAI-compatible server" -> "an OpenAI-compatible server"
        help_text = help_text.removeprefix(f"`axplug {c.name}`: ")
        subparsers.add_parser(c.name, help=help_text.rstrip("."), add_help=False)


def _exit_code(exc: BaseException) -> int | None:
    """The `AxplugError`'s own code (2: a mistake in what was asked, 1: a failed run), 1 for
    an I/O error, None for anything else: a bug, shown with its traceback."""
    from axplug.api._errors import AxplugError

    if isinstance(exc, AxplugError):
        return exc.exit_code
    return 1 if isinstance(exc, OSError) else None


def main(argv: Sequence[str] | None = None) -> int:
    """Run `axplug` with `argv` (default: the process arguments); returns the exit code."""
    saved = os.environ.get(DISABLE_ENV)
    try:
        return _main(argv, saved)
    finally:
        # Restore, so an in-process caller (tests, notebooks) is not left with plugins disabled.
        if saved is None:
            os.environ.pop(DISABLE_ENV, None)
        else:
            os.environ[DISABLE_ENV] = saved


def _main(argv: Sequence[str] | None, saved: str | None) -> int:
    # --disable applies before the plugin commands are discovered.
    disable = argparse.ArgumentParser(add_help=False)
    disable.add_argument("--disable", action="append", default=[])
    disabled = disable.parse_known_args(argv)[0].disable
    if disabled:
        os.environ[DISABLE_ENV] = ",".join(filter(None, [saved, *disabled]))
    return run_reporting_errors(lambda: _dispatch(argv))


def _dispatch(argv: Sequence[str] | None) -> int:
    parser = build_parser(argv)
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help, --version, usage errors: return the code
        return exc.code if isinstance(exc.code, int) else 2
    if args.command is None:
        parser.print_help(sys.stderr)
        return 2
    return args.run(args)


def run_reporting_errors(run: Callable[[], int]) -> int:
    """`run()` inside the one error boundary of the CLI; returns its exit code.

    axplug's own errors end in one `error:` line on stderr (their messages name the setting,
    step or plugin): exit 2 for a user's mistake, 1 for a failed run. `AXPLUG_TRACEBACK=1`
    re-raises them, traceback and all. Anything else is a bug: raised, with its traceback.
    Commands raise; they keep no `except` lists of their own. A full disk (ENOSPC, EDQUOT)
    is one line naming the device and the file: `no space left on DEVICE (mounted at DIR)
    writing PATH`, exit 1.
    """
    try:
        return run()
    except KeyboardInterrupt:
        # Ctrl-C: one line, not a traceback from wherever the command was. (`axplug train`
        # catches it itself, to save the step in flight.)
        print(
            "interrupted (SIGINT): stopped before finishing; what it was writing may be "
            "incomplete: rerun the command",
            file=sys.stderr,
        )
        return 130
    except BrokenPipeError:
        # `axplug list | head`: the reader left. Quiet exit, and no second error at shutdown.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except Exception as exc:
        code = _exit_code(exc)
        if code is None or os.environ.get(TRACEBACK_ENV):
            raise
        from axplug.config import strip_userinfo

        # A URI in a message (a library's, echoing a store's URL) shows no credentials.
        print(f"error: {strip_userinfo(_message(exc))}", file=sys.stderr)
        return code


def _message(exc: Exception) -> str:
    """The text of the `error:` line: the error's message, or for a full disk which disk
    and which file (the errno's own text names neither)."""
    from axplug.cli._no_space import is_no_space, no_space_message

    if isinstance(exc, OSError) and is_no_space(exc):
        return no_space_message(exc)
    cause, seen = exc.__cause__, set()  # a checkpoint save that failed on a full disk, say
    while cause is not None and id(cause) not in seen:
        if isinstance(cause, OSError) and is_no_space(cause):
            return f"{exc}; {no_space_message(cause)}"
        seen.add(id(cause))
        cause = cause.__cause__
    return str(exc)
