"""What discovery reports: kinds, statuses, the `Component` record and the lookup errors."""

from __future__ import annotations

import functools
import re
from typing import NamedTuple

from axplug.api._errors import AxplugError

__all__ = [
    "GROUP_PREFIX",
    "API_GROUP",
    "KINDS",
    "SUPPORTED_PLUGIN_API",
    "CORE_DISTRIBUTION",
    "FIRST_PARTY_ENTRY",
    "FIRST_PARTY_PREFIX",
    "STATUSES",
    "FAILURES",
    "Component",
    "normalize",
    "claims_first_party",
    "ComponentNotFoundError",
    "ComponentUnavailableError",
    "ComponentConflictError",
    "PluginLoadError",
]

GROUP_PREFIX = "axplug."
API_GROUP = "axplug.plugin_api"
KINDS = (
    "layers",
    "modifiers",
    "kernels",
    "mesh_rules",
    "storage",
    "presets",
    "inputs",
    "summary_writers",
    "architectures",
    "commands",
    "hooks",
    "data_sources",
    "optimizers",
    "schedules",
    "rewards",
    "proposers",
    "guides",
    "tool_parsers",
)
# Inclusive window of plugin API major versions this core can load.
SUPPORTED_PLUGIN_API = (1, 1)
CORE_DISTRIBUTION = "axplug"
# The entry a distribution of the axplug project puts in its `axplug.plugin_api` group
# (`first-party = "<root module>"`), read from metadata like every entry. Where it and a third
# party register the same kind and name, the plain name means the first-party component (the
# core and the presets rely on these names); the other stays loadable as `distribution:name`.
FIRST_PARTY_ENTRY = "first-party"
# Only a distribution named in the project's namespace may claim it (see `claims_first_party`).
FIRST_PARTY_PREFIX = "axplug-"
# `unavailable` is only reported by `axplug list --check`: loaded fine, cannot run here;
# `unchecked` by `axplug list` without it, for a plugin's kernel.
STATUSES = ("ok", "disabled", "broken", "conflict", "incompatible", "unavailable", "unchecked")
# What went wrong with a component that is not ok, as `Component.failure` records it (its
# `reason` says it in words, for people): `api` its distribution's plugin API is outside
# SUPPORTED_PLUGIN_API; `conflict` several distributions provide its name; `group` an
# entry-point group the core does not define; `missing` the entry point names a module or
# attribute that does not exist; `import` importing it raised; `hang` importing it did not
# finish; `hooks` hooks the core does not define, or invalid ones; `kind` the loaded object is
# not what its kind declares (axplug.api._kinds).
FAILURES = ("api", "conflict", "group", "missing", "import", "hang", "hooks", "kind")


@functools.lru_cache(maxsize=1024)  # every discover() normalizes each component's name
def normalize(distribution: str) -> str:
    """A distribution name compared the way pip does (PEP 503): `My_Plugin` -> `my-plugin`."""
    return re.sub(r"[-_.]+", "-", distribution).lower()


def distribution_key(dist) -> str:
    """An installed distribution's normalized name, from its directory where it has one
    (what importlib_metadata dedupes by): `dist.name` parses its METADATA."""
    return normalize(getattr(dist, "_normalized_name", None) or dist.name or "")


def claims_first_party(distribution: str, api_entries: list[str]) -> bool:
    """Whether `distribution` is first-party: its metadata declares FIRST_PARTY_ENTRY *and*
    its name is the core's or in the `axplug-` namespace.

    The marker alone would let any package take the plain names; the namespace alone would
    make every `axplug-*` upload first-party. Together an unrelated package cannot claim the
    status by its metadata, and a claim is never a silent win: first-party status only breaks
    a tie with third parties, so a false claim against a real first-party component makes the
    name ambiguous (`entry` asks for `distribution:name`, `doctor` fails) rather than taking
    it over.
    """
    name = normalize(distribution)
    in_namespace = name == CORE_DISTRIBUTION or name.startswith(FIRST_PARTY_PREFIX)
    return in_namespace and FIRST_PARTY_ENTRY in api_entries


# A NamedTuple rather than a frozen dataclass: `dataclasses` imports `inspect`, ~8 ms of the
# start-up budget of `axplug list`.
class Component(NamedTuple):
    """One registered component, as read from distribution metadata; immutable."""

    distribution: str
    version: str
    kind: str
    name: str
    value: str
    status: str = "ok"
    reason: str | None = None
    failure: str | None = None  # one of FAILURES when status is broken, incompatible, conflict
    first_party: bool = False  # a distribution of this project (see claims_first_party)

    @property
    def qualified_name(self) -> str:
        """`distribution:name`, unique even when two distributions share a name."""
        return f"{self.distribution}:{self.name}"

    @property
    def key(self) -> tuple[str, str, str]:
        return normalize(self.distribution), self.kind, self.name

    @property
    def loadable(self) -> bool:
        """Whether `load` may import it (disabled and incompatible ones are never imported)."""
        return self.status not in ("disabled", "incompatible")

    def describe(self) -> str:
        return f"{self.kind} {self.name!r} from {self.distribution} {self.version} ({self.value})"


class ComponentNotFoundError(AxplugError, LookupError):
    """No component of that kind has that name."""

    exit_code = 2


class ComponentUnavailableError(ComponentNotFoundError):
    """The component exists but is disabled or incompatible, so it is never imported."""


class ComponentConflictError(AxplugError, LookupError):
    """Several distributions provide the name; qualify it as `distribution:name`."""

    exit_code = 2


class PluginLoadError(AxplugError, ImportError):
    """Importing a component failed; the failure is recorded and shown by `axplug list`."""

    def __init__(self, message: str, component: Component):
        super().__init__(message)
        self.component = component
