"""`axplug info NAME`: where a component comes from, its docstring and its default config."""

from __future__ import annotations

import argparse
from typing import Any

from axplug.api import add_command
from axplug.registry import KINDS, Component

__all__ = ["add_parser", "run", "find"]

EPILOG = """\
examples:
  axplug info rms_norm                    a core layer: its source and default config
  axplug info scan_layers --kind modifiers    when several kinds share the name
  axplug info axplug:rms_norm                 when several distributions share the name
"""


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    parser = add_command(
        subparsers,
        "info",
        run,
        help="show one component: source, docstring, default config",
        description="Show where a component comes from, its docstring and, when it has\n"
        "default_config(), every field of its default config. Imports the component.",
        epilog=EPILOG,
    )
    parser.add_argument("name", metavar="NAME", help="component name, or distribution:name")
    parser.add_argument("--kind", choices=KINDS, help="the component's kind, when ambiguous")
    return parser


def run(args: argparse.Namespace) -> int:
    from axplug import registry

    component = find(args.name, args.kind)
    obj, code = None, 0
    if component.loadable:
        try:
            obj = registry.load(component.kind, component.qualified_name)
        except registry.PluginLoadError:
            component, code = registry.entry(component.kind, component.qualified_name), 1
    print(f"name:          {component.name}")
    print(f"kind:          {component.kind}")
    print(f"distribution:  {component.distribution} {component.version}")
    print(f"entry point:   {component.value}")
    print(
        f"status:        {component.status}" + (f": {component.reason}" if component.reason else "")
    )
    if obj is not None:
        code = max(code, _print_object(obj, component.kind))
    return code


def find(name: str, kind: str | None = None) -> Component:
    """The one component called `name` (of `kind`); else a registry LookupError that says how
    to narrow it."""
    from axplug import registry

    if kind is not None:
        return registry.entry(kind, name)
    found = []
    for k in KINDS:
        try:
            found.append(registry.entry(k, name))
        except registry.ComponentNotFoundError:
            continue
    if len(found) == 1:
        return found[0]
    if found:
        kinds = ", ".join(c.kind for c in found)
        raise registry.ComponentConflictError(
            f"{name!r} names components of several kinds ({kinds}); pass one, e.g. "
            f"`axplug info {name} --kind {found[0].kind}`"
        )
    import difflib

    known = sorted({c.name for c in registry.discover()})
    close = difflib.get_close_matches(name.rpartition(":")[2], known, n=3)
    hint = f" (did you mean {' or '.join(map(repr, close))}?)" if close else ""
    raise registry.ComponentNotFoundError(f"no component named {name!r}{hint}; see `axplug list`")


def _print_object(obj: Any, kind: str) -> int:
    import inspect

    from axplug.config import Configurable
    from axplug.presets import Preset

    if isinstance(obj, Preset):
        return _print_preset(obj)
    doc = (inspect.getdoc(obj) or "").strip()
    # The first paragraph, whole: a first line alone can stop mid-sentence.
    summary = " ".join(doc.split("\n\n")[0].split()) if doc else "(none)"
    print(f"doc:           {summary}")
    # A component may describe its state on this machine (e.g. which kernel dispatch picks).
    extra = None
    if kind == "kernels":
        from axplug.kernels import describe_kernels

        extra = describe_kernels
    elif kind == "layers":  # a BaseLayer (checked at load); jax only for these two kinds
        extra = obj.info_lines
    if extra is not None:
        try:
            for line in extra():
                print(line)
        except Exception as exc:  # noqa: BLE001 - a plugin's description must not break info
            print(f"info: error: {type(exc).__name__}: {exc}")
    if not (isinstance(obj, type) and issubclass(obj, Configurable)):
        return 0
    return _print_config("default config", obj.default_config)


def _print_preset(preset: Any) -> int:
    """A preset: what it trains, the modifiers that complete it, its effective config."""
    from axplug.presets import preset_config

    print(f"description:   {preset.description}")
    for spec in preset.modifiers or ("(none)",):
        name = spec.partition(":")[0]
        provider = preset.providers.get(name)
        print(f"modifier:      {spec}" + (f"  (from {provider})" if provider else ""))
    title = "config (the preset with its modifiers applied)"
    return _print_config(title, lambda: preset_config(preset.name))


def _print_config(title: str, build) -> int:
    """`title:` and the config `build()` gives, one indented line per field; 1 if it fails
    (a required plugin missing, a bad default)."""
    try:
        text = build().debug_string()
    except Exception as exc:  # noqa: BLE001 - a plugin's config must not break info
        print(f"{title}: error: {type(exc).__name__}: {exc}")
        return 1
    print(f"{title}:")
    for line in text.splitlines():
        print(f"  {line}")
    return 0
