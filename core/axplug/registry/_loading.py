"""Resolve a component by kind and name, and import it lazily, once, in isolation."""

from __future__ import annotations

import importlib
from typing import Any

from axplug.registry import _discovery
from axplug.registry._component import (
    GROUP_PREFIX,
    Component,
    ComponentConflictError,
    ComponentNotFoundError,
    ComponentUnavailableError,
    PluginLoadError,
    normalize,
)

__all__ = [
    "conformed",
    "names",
    "entry",
    "load",
    "load_as",
    "load_component",
    "load_within",
    "reset",
    "shadowing_first_party",
]

_loaded: dict[tuple[str, str, str], Any] = {}


def reset() -> None:
    """Forget discovered metadata, loaded objects and recorded failures (for tests)."""
    from axplug.registry import _hooks

    _loaded.clear()
    _warned.clear()
    _hooks._reported.clear()
    _discovery.clear()
    importlib.invalidate_caches()


def names(kind: str) -> list[str]:
    """Names `load(kind, name)` accepts; a name two distributions share appears as `dist:name`,
    except the first-party one, which keeps the plain name."""
    usable = [c for c in _discovery.discover(kind) if c.loadable]
    counts: dict[str, int] = {}
    for c in usable:
        counts[c.name] = counts.get(c.name, 0) + 1
    return sorted(
        c.name if counts[c.name] == 1 or _winner(usable, c.name) is c else c.qualified_name
        for c in usable
    )


def _winner(usable: list[Component], name: str) -> Component | None:
    """The one first-party component among several named `name`, if there is exactly one."""
    first = [c for c in usable if c.name == name and c.first_party]
    return first[0] if len(first) == 1 else None


def entry(kind: str, name: str) -> Component:
    """The component `name` (or `distribution:name`) of `kind`, whatever its status; no import."""
    dist, _, plain = name.rpartition(":")
    matches = [
        c
        for c in _discovery.discover(kind)
        if c.name == plain and (not dist or normalize(c.distribution) == normalize(dist))
    ]
    if not matches:
        raise _not_found(kind, name, plain)
    usable = [c for c in matches if c.loadable]
    if len(usable) > 1 and (winner := _winner(usable, plain)) is not None:
        _warn_shadowed(kind, winner, [c for c in usable if c is not winner])
        return winner
    if len(usable) > 1:
        forms = ", ".join(repr(c.qualified_name) for c in usable)
        raise ComponentConflictError(
            f"{kind} {name!r} is provided by several distributions: {forms}; "
            f"name one of them, e.g. {usable[0].qualified_name!r}"
        )
    return (usable or matches)[0]


def shadowing_first_party(components: list[Component]) -> list[Component]:
    """The third-party components among `components` that reuse a first-party kind and name."""
    first = {(c.kind, c.name) for c in components if c.first_party and c.status == "conflict"}
    return [
        c
        for c in components
        if c.status == "conflict" and not c.first_party and (c.kind, c.name) in first
    ]


_warned: set[tuple[str, str]] = set()


def _warn_shadowed(kind: str, winner: Component, others: list[Component]) -> None:
    if (kind, winner.name) in _warned:
        return
    _warned.add((kind, winner.name))
    import logging

    logging.getLogger("axplug.registry").warning(
        "%s %r is also provided by %s; the first-party one from %s is used (load the other as %s)",
        kind,
        winner.name,
        ", ".join(c.distribution for c in others),
        winner.distribution,
        " or ".join(repr(c.qualified_name) for c in others),
    )


def load(kind: str, name: str) -> Any:
    """Import and return the component `name` (or `distribution:name`) of `kind`, cached."""
    component = entry(kind, name)
    if not component.loadable:
        raise ComponentUnavailableError(
            f"{component.describe()} is {component.status}: {component.reason}"
        )
    return load_component(component)


_conformed: dict[tuple[type, type], type] = {}


def conformed(obj: Any, base: type) -> Any:
    """`obj` (a class is built with no arguments) as an instance of `base`, the kind's
    declared base: a class that does not derive from it is given it as a last base, so each
    optional member it leaves out reads the base's default and callers never probe."""
    cls = obj if isinstance(obj, type) else type(obj)
    if not issubclass(cls, base):
        key = (cls, base)
        if key not in _conformed:
            names = {"__module__": cls.__module__, "__qualname__": cls.__qualname__}
            _conformed[key] = type(cls.__name__, (cls, base), {**names, "__doc__": cls.__doc__})
        if not isinstance(obj, type):  # an instance: the same state under the mixed class
            import copy

            obj = copy.copy(obj)
            obj.__class__ = _conformed[key]
        cls = _conformed[key]
    return cls() if isinstance(obj, type) else obj


def load_as(kind: str, name: str, base: type) -> Any:
    """`load(kind, name)` as an instance of the kind's declared `base` (see `conformed`)."""
    return conformed(load(kind, name), base)


def load_component(component: Component) -> Any:
    """Import `component` once; a failure is recorded, shown by `axplug list`, and raised."""
    if component.status != "broken" and component.key in _loaded:
        return _loaded[component.key]
    cause: BaseException | None = None
    reason = component.reason if component.status == "broken" else None
    if reason is None:
        import importlib_metadata

        group = GROUP_PREFIX + component.kind
        try:
            obj = importlib_metadata.EntryPoint(component.name, component.value, group).load()
        # A plugin must never take the host down, not even by calling sys.exit on import.
        except (Exception, SystemExit) as exc:
            cause, reason = exc, _summary(exc)
            _discovery.record_failure(component, reason, _import_failure(component, exc))
        else:
            from axplug.registry._kinds import check_kind

            if (missing := check_kind(component.kind, obj)) is None:
                _loaded[component.key] = obj
                return obj
            reason = (
                f"{component.value} is not a {component.kind} component: {missing} "
                "(see docs/plugin-reference.md)"
            )
            _discovery.record_failure(component, reason, "kind")
    raise PluginLoadError(
        f"cannot load {component.describe()}: {reason}; fix or reinstall {component.distribution},"
        f" or skip it with {_discovery.DISABLE_ENV}={component.distribution}",
        component,
    ) from cause


def load_within(component: Component, seconds: float) -> bool:
    """`load_component` on a helper thread, given up after `seconds` (a plugin that hangs at
    import is recorded as broken and left behind); whether it loaded."""
    import threading

    done: list[bool] = []

    def target() -> None:
        try:
            load_component(component)
        except (ImportError, LookupError):
            return  # recorded
        done.append(True)

    thread = threading.Thread(target=target, name=f"axplug-import-{component.name}", daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        _discovery.record_failure(
            component,
            f"import did not finish within {seconds:g} s (it hangs at import); skip it with "
            f"{_discovery.DISABLE_ENV}={component.distribution}",
            "hang",
        )
    return bool(done)


def _import_failure(component: Component, exc: BaseException) -> str:
    """`missing` when the entry point names nothing (its own module or attribute is not
    there), `import` when importing it raised (a module it imports, its own code)."""
    if isinstance(exc, AttributeError):
        return "missing"
    if isinstance(exc, ModuleNotFoundError) and exc.name:
        module = component.value.split(":", 1)[0].strip()
        if module == exc.name or module.startswith(exc.name + "."):
            return "missing"
    return "import"


def _summary(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__


def _not_found(kind: str, name: str, plain: str) -> ComponentNotFoundError:
    import difflib

    available = names(kind)
    close = difflib.get_close_matches(name, available, n=3)
    hint = f" (did you mean {' or '.join(map(repr, close))}?)" if close else ""
    others = sorted({c.kind for c in _discovery.discover() if c.name == plain and c.kind != kind})
    elsewhere = f"; {plain!r} exists as kind {', '.join(others)}" if others else ""
    listing = ", ".join(available) if available else "none installed"
    return ComponentNotFoundError(
        f"no {kind} component named {name!r}{hint}{elsewhere}; available {kind}: {listing} "
        f"(see `axplug list --kind {kind}`)"
    )
