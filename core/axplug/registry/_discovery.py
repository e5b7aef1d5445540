"""One cached metadata scan of the `axplug.*` entry points, and the status of every component."""

from __future__ import annotations

import os

from axplug import __version__
from axplug.registry._component import (
    API_GROUP,
    CORE_DISTRIBUTION,
    FAILURES,
    FIRST_PARTY_ENTRY,
    GROUP_PREFIX,
    KINDS,
    SUPPORTED_PLUGIN_API,
    Component,
    claims_first_party,
    distribution_key,
    normalize,
)

__all__ = ["DISABLE_ENV", "ALLOW_ENV", "discover", "record_failure", "clear"]

DISABLE_ENV = "AXPLUG_DISABLE_PLUGINS"
ALLOW_ENV = "AXPLUG_LOAD_PLUGINS"

_scanned: list[Component] | None = None
_failures: dict[tuple[str, str, str], tuple[str, str]] = {}  # key -> (reason, failure)
# Every component with its status, per (DISABLE_ENV, ALLOW_ENV) values: entry lookups ask
# for it thousands of times; a load failure or `clear()` forgets it.
_statuses: dict[tuple[str | None, str | None], list[Component]] = {}


def clear() -> None:
    """Forget the metadata scan and every recorded load failure."""
    global _scanned
    _scanned = None
    _failures.clear()
    _statuses.clear()


def record_failure(component: Component, reason: str, failure: str) -> None:
    """Marks `component` broken from now on: `failure` (one of FAILURES), `reason` in words."""
    assert failure in FAILURES, failure
    _failures[component.key] = (reason, failure)
    _statuses.clear()


def discover(kind: str | None = None) -> list[Component]:
    """Every installed component (of `kind`), with its status; reads metadata, imports no plugin."""
    if kind is not None and kind not in KINDS:
        raise ValueError(f"unknown component kind {kind!r}; valid kinds: {', '.join(KINDS)}")
    env = (os.environ.get(DISABLE_ENV), os.environ.get(ALLOW_ENV))
    if (components := _statuses.get(env)) is None:
        disable, allow = _env_names(DISABLE_ENV), _env_names(ALLOW_ENV)
        components = _mark_conflicts([_with_status(c, disable, allow) for c in _scan()])
        components.sort(key=lambda c: (normalize(c.distribution), c.kind, c.name))
        _statuses[env] = components
    return [c for c in components if kind is None or c.kind == kind]


def _scan() -> list[Component]:
    global _scanned
    if _scanned is None:
        _scanned = list(_read_metadata())
    return _scanned


def _read_metadata():
    # Imported here, not at module level: it costs ~40 ms and `axplug --help` never needs it.
    import importlib_metadata

    seen: set[str] = set()
    for dist in importlib_metadata.distributions():
        key = distribution_key(dist)
        # The first distribution of a name on sys.path shadows later ones, as for imports.
        if key in seen:
            continue
        seen.add(key)
        text = dist.read_text("entry_points.txt")
        if not text or GROUP_PREFIX not in text:
            continue
        eps = [ep for ep in dist.entry_points if ep.group.startswith(GROUP_PREFIX)]
        if not eps:
            continue
        name, version = _name_version(dist, key)
        api_entries = [ep.name for ep in eps if ep.group == API_GROUP]
        first_party = claims_first_party(name, api_entries)
        problem = _api_problem(name, [e for e in api_entries if e != FIRST_PARTY_ENTRY])
        done: set[tuple[str, str]] = set()
        for ep in eps:
            kind = ep.group[len(GROUP_PREFIX) :]
            if ep.group == API_GROUP or (kind, ep.name) in done:
                continue
            done.add((kind, ep.name))
            status, reason, failure = "ok", None, None
            if problem:
                status, reason, failure = "incompatible", problem, "api"
            if kind not in KINDS:
                status, reason, failure = "broken", _unknown_kind(ep.group), "group"
            yield Component(
                name, version, kind, ep.name, ep.value, status, reason, failure, first_party
            )


def _name_version(dist, key: str) -> tuple[str, str]:
    # Read the two headers directly: `dist.metadata` imports and runs the email parser (~15 ms).
    text = dist.read_text("METADATA") or dist.read_text("PKG-INFO") or ""
    found: dict[str, str] = {}
    for line in text.splitlines():
        if not line.strip():
            break
        header, sep, value = line.partition(":")
        if sep and header in ("Name", "Version"):
            found.setdefault(header, value.strip())
    return found.get("Name") or key, found.get("Version") or "unknown"


def _unknown_kind(group: str) -> str:
    import difflib

    kind = group[len(GROUP_PREFIX) :]
    close = difflib.get_close_matches(kind, KINDS, n=1)
    hint = f" (did you mean {GROUP_PREFIX}{close[0]}?)" if close else ""
    return f"unknown entry-point group {group!r}{hint}; valid groups: " + ", ".join(
        GROUP_PREFIX + k for k in KINDS
    )


def _major(version: str) -> int | None:
    head = version.strip().split(".")[0]
    return int(head) if head.isdigit() else None


def _api_problem(distribution: str, declared: list[str]) -> str | None:
    """Why `distribution` cannot be loaded by this core's plugin API window, or None."""
    lo, hi = SUPPORTED_PLUGIN_API
    window = str(lo) if lo == hi else f"{lo} to {hi}"
    supports = f"axplug {__version__} supports plugin API {window}"
    if not declared:
        return (
            f"declares no plugin API; {supports}: upgrade {distribution}, or declare the API "
            f'in its pyproject.toml: [project.entry-points."{API_GROUP}"] "{hi}" = "<root module>"'
        )
    majors = [m for m in map(_major, declared) if m is not None]
    if any(lo <= m <= hi for m in majors):
        return None
    if majors and max(majors) > hi:
        fix = f"upgrade axplug (pip install -U axplug) or install an older {distribution}"
    else:
        fix = f"upgrade the plugin (pip install -U {distribution})"
    return f"declares plugin API {', '.join(declared)}; {supports}: {fix}"


def _env_names(var: str) -> set[str] | None:
    raw = os.environ.get(var)
    if raw is None:
        return None
    return {normalize(n.strip()) for n in raw.split(",") if n.strip()}


def _with_status(c: Component, disable: set[str] | None, allow: set[str] | None) -> Component:
    dist = normalize(c.distribution)
    if dist != CORE_DISTRIBUTION:
        if disable and dist in disable:
            return c._replace(status="disabled", reason=f"{DISABLE_ENV} lists it")
        if allow is not None and dist not in allow:
            return c._replace(status="disabled", reason=f"{ALLOW_ENV} does not list it")
    if c.status == "ok" and (recorded := _failures.get(c.key)):
        return c._replace(status="broken", reason=recorded[0], failure=recorded[1])
    return c


def _mark_conflicts(components: list[Component]) -> list[Component]:
    """Mark names that several distributions provide; hooks are exempt, they all run."""
    owners: dict[tuple[str, str], list[Component]] = {}
    for c in components:
        if c.loadable and c.kind in KINDS and c.kind != "hooks":
            owners.setdefault((c.kind, c.name), []).append(c)
    out = []
    for c in components:
        rivals = [o for o in owners.get((c.kind, c.name), []) if o is not c]
        if c.status == "ok" and rivals:
            others = ", ".join(o.qualified_name for o in rivals)
            first = [o for o in (c, *rivals) if o.first_party]
            if len(first) == 1 and first[0] is c:
                reason = f"also provided by {others}; {c.name!r} means this first-party one"
            else:
                reason = f"also provided by {others}; load it as {c.qualified_name!r}"
            c = c._replace(status="conflict", reason=reason, failure="conflict")
        out.append(c)
    return out
