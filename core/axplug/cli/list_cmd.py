"""`axplug list`: every installed component, its distribution and its status."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from axplug.registry import KINDS, Component

__all__ = ["add_parser", "run", "as_dict", "status_text"]

EPILOG = """\
examples:
  axplug list                     a table of every component (plain columns when piped)
  axplug list --kind modifiers    only one kind
  axplug list --json              a JSON array for scripts; each object has the keys
                                  distribution, version, kind, name, status, reason, entry_point
  axplug list --check             also import each component; exit 1 if any is broken or
                                  reuses a first-party name

status is one of: ok, disabled, broken, conflict (two distributions share the name; use
`dist:name`), incompatible (the plugin targets another plugin API than this core).
"""

_STYLES = {"ok": "green", "disabled": "dim", "broken": "red", "conflict": "yellow"}


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "list",
        help="list installed components and their status",
        description="List every component that installed distributions register. Reads\n"
        "metadata only: imports no plugin and not jax, unless --check is given.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--kind", choices=KINDS, help="only components of this kind")
    parser.add_argument("--json", action="store_true", help="print a JSON array instead of a table")
    parser.add_argument(
        "--check", action="store_true", help="import each component in isolation and report it"
    )
    parser.set_defaults(run=run)
    return parser


def run(args: argparse.Namespace) -> int:
    from axplug import registry

    components = registry.discover(args.kind)
    if args.check:
        components = _check(components, args.kind)
    if args.json:
        import json

        print(json.dumps([as_dict(c) for c in components], indent=2))
    elif sys.stdout.isatty():
        _print_table(components)
    else:  # piped: plain columns for grep/awk, and no rich import to pay for
        _print_plain(components)
    if not args.check:
        return 0
    shadowing = registry.shadowing_first_party(components)
    for c in shadowing:
        print(
            f"conflict: {c.distribution} registers {c.kind} {c.name!r}, a first-party name; "
            f"the plain name means the first-party one, this one loads as {c.qualified_name!r}",
            file=sys.stderr,
        )
    return 1 if shadowing or any(c.status == "broken" for c in components) else 0


def as_dict(component: Component) -> dict[str, Any]:
    """The stable JSON form of a component; scripts rely on these keys."""
    return {
        "distribution": component.distribution,
        "version": component.version,
        "kind": component.kind,
        "name": component.name,
        "status": component.status,
        "reason": component.reason,
        "entry_point": component.value,
    }


def status_text(component: Component) -> str:
    """`ok`, `conflict`, or `status: reason`."""
    if component.status in ("ok", "conflict") or not component.reason:
        return component.status
    return f"{component.status}: {component.reason}"


IMPORT_TIMEOUT_S = 30.0


def _check(components: list[Component], kind: str | None) -> list[Component]:
    from axplug import registry

    for c in components:
        if c.loadable and c.kind in KINDS:
            # A failure (or a hang) is recorded; the fresh discovery below reports it.
            registry.load_within(c, IMPORT_TIMEOUT_S)
    if any(c.kind == "hooks" for c in components):
        registry.plugin_manager()  # also rejects hooks the core does not define
    return [_availability(c) for c in registry.discover(kind)]


def _availability(c: Component) -> Component:
    """A loaded kernel that cannot run on this machine is `unavailable`, with its reason."""
    from axplug import registry

    if c.kind != "kernels" or c.status != "ok":
        return c
    kernel = registry.load(c.kind, c.qualified_name)
    try:
        kernel = kernel() if isinstance(kernel, type) else kernel
        check = getattr(kernel, "availability", None)
        reason = check() if callable(check) else None
    except Exception as exc:  # noqa: BLE001 - a plugin's self-check must not break listing
        reason = f"availability check raised {type(exc).__name__}: {exc}"
    return c._replace(status="unavailable", reason=reason) if reason else c


def _caption(components: list[Component]) -> str:
    dists = {c.distribution for c in components}
    return f"{len(components)} component(s) from {len(dists)} distribution(s)"


def _print_plain(components: list[Component]) -> None:
    if not components:
        print("no components installed; see `axplug list --help`")
        return
    rows = [("DISTRIBUTION", "VERSION", "KIND", "NAME", "STATUS")]
    rows += [(c.distribution, c.version, c.kind, c.name, status_text(c)) for c in components]
    widths = [max(len(row[i]) for row in rows) for i in range(4)]
    for row in rows:
        cells = (cell.ljust(width) for cell, width in zip(row[:4], widths, strict=True))
        print("  ".join(cells) + "  " + row[4])
    print(_caption(components))


def _print_table(components: list[Component]) -> None:
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    console = Console()
    if not components:
        console.print("no components installed; see `axplug list --help`")
        return
    table = Table(caption=_caption(components))
    for column in ("distribution", "version", "kind", "name", "status"):
        table.add_column(column, overflow="fold")
    for c in components:
        # Text, not str: reasons may contain [brackets] that rich would read as markup.
        cells = (c.distribution, c.version, c.kind, c.name)
        status = Text(status_text(c), style=_STYLES.get(c.status, "magenta"))
        table.add_row(*map(Text, cells), status)
    console.print(table)
