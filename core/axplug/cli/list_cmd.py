"""`axplug list`: every installed component, its distribution and its status."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from axplug.api import add_command
from axplug.registry import KINDS, Component
from axplug.registry._component import CORE_DISTRIBUTION

__all__ = ["add_parser", "run", "as_dict", "status_text"]

EPILOG = """\
examples:
  axplug list                     a table of every component (plain columns when piped)
  axplug list --kind modifiers    only one kind
  axplug list --by-dist           one row per distribution: its components, status, summary
  axplug list --json              a JSON array for scripts; each object has the keys
                                  distribution, version, kind, name, status, reason,
                                  entry_point, description
  axplug list --check             also import each component; exit 1 if any is broken or
                                  reuses a first-party name

status is one of: ok, disabled, broken, conflict (two distributions share the name; use
`dist:name`), incompatible (the plugin targets another plugin API than this core),
unchecked (a hardware kernel: whether it runs here is known only after --check, which
says ok or unavailable). The description is the first sentence of the component's
docstring, read from its source without importing it; with --check, a mesh rule's is the
pattern it matches and its own description.
"""

_STYLES = {
    "ok": "green",
    "disabled": "dim",
    "broken": "red",
    "conflict": "yellow",
    "unchecked": "cyan",
}


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    parser = add_command(
        subparsers,
        "list",
        run,
        help="list installed components and their status",
        description="List every component that installed distributions register. Reads\n"
        "metadata only: imports no plugin and not jax, unless --check is given.",
        epilog=EPILOG,
    )
    parser.add_argument("--kind", choices=KINDS, help="only components of this kind")
    parser.add_argument("--json", action="store_true", help="print a JSON array instead of a table")
    parser.add_argument(
        "--by-dist", action="store_true", help="one row per distribution instead of per component"
    )
    parser.add_argument(
        "--check", action="store_true", help="import each component in isolation and report it"
    )
    return parser


def run(args: argparse.Namespace) -> int:
    from axplug import registry

    components = registry.discover(args.kind)
    if args.check:
        components = _check(components, args.kind)
    else:
        components = [_unchecked(c) for c in components]
    descriptions = registry.describe(components)
    if args.check:
        descriptions.update(_rule_patterns(components))
    if args.by_dist:
        rows = _distribution_rows(components)
        header = ("DISTRIBUTION", "VERSION", "COMPONENTS", "STATUS", "SUMMARY")
    else:
        rows = [
            (c.distribution, c.version, c.kind, c.name, status_text(c), descriptions[c])
            for c in components
        ]
        header = ("DISTRIBUTION", "VERSION", "KIND", "NAME", "STATUS", "DESCRIPTION")
    if args.json:
        import json

        data = (
            [dict(zip((h.lower() for h in header), row, strict=True)) for row in rows]
            if args.by_dist
            else [as_dict(c, descriptions[c]) for c in components]
        )
        print(json.dumps(data, indent=2))
    elif not components:
        print("no components installed; see `axplug list --help`")
    elif sys.stdout.isatty():
        _print_table(header, rows, components)
    else:  # piped: plain columns for grep/awk, and no rich import to pay for
        _print_plain(header, rows, components)
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


def as_dict(component: Component, description: str = "") -> dict[str, Any]:
    """The stable JSON form of a component; scripts rely on these keys."""
    return {
        "distribution": component.distribution,
        "version": component.version,
        "kind": component.kind,
        "name": component.name,
        "status": component.status,
        "reason": component.reason,
        "entry_point": component.value,
        "description": description,
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


def _unchecked(c: Component) -> Component:
    """A plugin's kernel that loads is not known to run here until --check asks it."""
    if c.kind == "kernels" and c.status == "ok" and c.distribution != CORE_DISTRIBUTION:
        return c._replace(status="unchecked", reason="")
    return c


def _rule_patterns(components: list[Component]) -> dict[Component, str]:
    """`PATTERN: description` of each loaded mesh rule."""
    from axplug import registry

    out = {}
    for c in components:
        if c.kind == "mesh_rules" and c.status == "ok":
            try:
                rule = registry.load(c.kind, c.qualified_name)()
                out[c] = f"{rule.pattern}: {rule.description}" if rule.description else rule.pattern
            except Exception:  # noqa: BLE001 - a broken rule keeps its docstring description
                continue
    return out


def _distribution_rows(components: list[Component]) -> list[tuple[str, ...]]:
    """(distribution, version, "N: k kind, ...", statuses, metadata summary) per distribution."""
    import importlib_metadata

    by_dist: dict[str, list[Component]] = {}
    for c in components:
        by_dist.setdefault(c.distribution, []).append(c)
    rows = []
    for dist, members in by_dist.items():
        kinds: dict[str, int] = {}
        statuses: dict[str, int] = {}
        for c in members:
            kinds[c.kind] = kinds.get(c.kind, 0) + 1
            statuses[c.status] = statuses.get(c.status, 0) + 1
        counts = ", ".join(f"{n} {kind}" for kind, n in kinds.items())
        status = ", ".join(f"{n} {s}" for s, n in statuses.items())
        try:
            summary = importlib_metadata.distribution(dist).metadata.get("Summary") or ""
        except importlib_metadata.PackageNotFoundError:
            summary = ""
        rows.append((dist, members[0].version, f"{len(members)}: {counts}", status, summary))
    return rows


def _availability(c: Component) -> Component:
    """A loaded kernel that cannot run on this machine is `unavailable`, with its reason."""
    from axplug import registry
    from axplug.api import Kernel

    if c.kind != "kernels" or c.status != "ok":
        return c
    kernel = registry.load_as(c.kind, c.qualified_name, Kernel)
    try:
        reason = kernel.availability()
    except Exception as exc:  # noqa: BLE001 - a plugin's self-check must not break listing
        reason = f"availability check raised {type(exc).__name__}: {exc}"
    return c._replace(status="unavailable", reason=reason) if reason else c


def _caption(components: list[Component]) -> str:
    dists = {c.distribution for c in components}
    return f"{len(components)} component(s) from {len(dists)} distribution(s)"


def _print_plain(header: tuple, rows: list[tuple], components: list[Component]) -> None:
    rows = [header, *rows]
    widths = [max(len(row[i]) for row in rows) for i in range(len(header) - 1)]
    for row in rows:
        cells = (cell.ljust(width) for cell, width in zip(row[:-1], widths, strict=True))
        print(("  ".join(cells) + "  " + row[-1]).rstrip())
    print(_caption(components))


_NAMES = ("DISTRIBUTION", "VERSION", "KIND", "NAME")


def _print_table(header: tuple, rows: list[tuple], components: list[Component]) -> None:
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    table = Table(caption=_caption(components))
    for i, column in enumerate(header):
        # Names keep their width and never wrap; the other columns wrap to fit the terminal,
        # sharing its width by their longest cells.
        widest = max(len(row[i]) for row in rows)
        if column in _NAMES:
            table.add_column(column.lower(), no_wrap=True, min_width=widest)
        else:
            table.add_column(column.lower(), overflow="fold", ratio=max(1, min(widest, 80)))
    status_column = header.index("STATUS")
    styles = {} if len(rows) != len(components) else {i: c.status for i, c in enumerate(components)}
    for i, row in enumerate(rows):
        # Text, not str: reasons may contain [brackets] that rich would read as markup.
        cells = [Text(cell) for cell in row]
        cells[status_column].stylize(_STYLES.get(styles.get(i, "ok"), "magenta"))
        table.add_row(*cells)
    Console().print(table)
