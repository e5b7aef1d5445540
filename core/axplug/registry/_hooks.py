"""The pluggy manager that runs every installed `axplug.hooks` plugin."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from axplug.registry import _discovery
from axplug.registry._component import Component, PluginLoadError
from axplug.registry._loading import load_component

if TYPE_CHECKING:
    import pluggy

__all__ = ["plugin_manager"]

_reported: set[tuple[str, str, str]] = set()  # hooks plugins whose load failure was logged


def plugin_manager(*plugins: object) -> pluggy.PluginManager:
    """A manager with the core hookspecs, every valid `axplug.hooks` plugin, then `plugins`."""
    import pluggy

    from axplug import hookspecs

    pm = pluggy.PluginManager(hookspecs.PROJECT)
    pm.add_hookspecs(hookspecs)
    for component in _discovery.discover("hooks"):
        if component.loadable:
            _register(pm, component)
    for plugin in plugins:
        pm.register(plugin)
    # Only the caller's own plugins can still fail here: entry-point ones were vetted above.
    pm.check_pending()
    return pm


def _register(pm: pluggy.PluginManager, component: Component) -> None:
    import pluggy

    try:
        obj = load_component(component)
    except PluginLoadError as exc:
        # Recorded (`axplug list` shows it as broken); said once here, since its hooks will
        # not run.
        if component.key not in _reported:
            _reported.add(component.key)
            logging.getLogger("axplug.registry").warning("%s; its hooks will not run", exc)
        return
    if pm.is_registered(obj):
        return
    try:
        pm.register(obj, name=component.qualified_name)
    except pluggy.PluginValidationError as exc:
        _reject(pm, obj, component, f"invalid hook implementation: {exc}")
        return
    if unknown := _unknown_hooks(pm, obj):
        known = sorted(n for n, caller in vars(pm.hook).items() if caller.has_spec())
        _reject(
            pm,
            obj,
            component,
            f"implements unknown hook(s) {_with_hint(unknown, known)}; "
            f"axplug defines: {', '.join(known)}",
        )


def _reject(pm: pluggy.PluginManager, obj: object, component: Component, reason: str) -> None:
    # pluggy keeps a plugin half-registered when validation fails part-way.
    if pm.is_registered(obj):
        pm.unregister(obj)
    _discovery.record_failure(component, reason, "hooks")


def _unknown_hooks(pm: pluggy.PluginManager, obj: object) -> list[str]:
    return sorted(
        caller.name
        for caller in pm.get_hookcallers(obj) or []
        if not caller.has_spec()
        and any(impl.plugin is obj and not impl.optionalhook for impl in caller.get_hookimpls())
    )


def _with_hint(unknown: list[str], known: list[str]) -> str:
    import difflib

    parts = []
    for name in unknown:
        close = difflib.get_close_matches(name, known, n=1)
        parts.append(f"{name} (did you mean {close[0]}?)" if close else name)
    return ", ".join(parts)
