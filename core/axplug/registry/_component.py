"""What discovery reports: kinds, statuses, the `Component` record and the lookup errors."""

from __future__ import annotations

import re
from typing import NamedTuple

__all__ = [
    "GROUP_PREFIX",
    "API_GROUP",
    "KINDS",
    "SUPPORTED_PLUGIN_API",
    "CORE_DISTRIBUTION",
    "FIRST_PARTY",
    "STATUSES",
    "FAILURES",
    "Component",
    "normalize",
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
    "hf_mappings",
    "commands",
    "hooks",
)
# Inclusive window of plugin API major versions this core can load.
SUPPORTED_PLUGIN_API = (1, 1)
CORE_DISTRIBUTION = "axplug"
# The project's own distributions: where one of them and a third party register the same
# kind and name, the plain name means the first-party component (the core and the presets
# rely on these names); the other is still loadable as `distribution:name`.
FIRST_PARTY = frozenset(
    {
        "axplug",
        "axplug-attention",
        "axplug-moe",
        "axplug-gpu",
        "axplug-tpu",
        "axplug-trainium",
        "axplug-checkpoint-cloud",
        "axplug-wandb",
        "axplug-mlflow",
        "axplug-serve",
    }
)
# `unavailable` is only reported by `axplug list --check`: loaded fine, cannot run here;
# `unchecked` by `axplug list` without it, for a plugin's kernel.
STATUSES = ("ok", "disabled", "broken", "conflict", "incompatible", "unavailable", "unchecked")
# What went wrong with a component that is not ok, as `Component.failure` records it (its
# `reason` says it in words, for people): `api` its distribution's plugin API is outside
# SUPPORTED_PLUGIN_API; `conflict` several distributions provide its name; `group` an
# entry-point group the core does not define; `missing` the entry point names a module or
# attribute that does not exist; `import` importing it raised; `hang` importing it did not
# finish; `hooks` hooks the core does not define, or invalid ones; `kind` the loaded object is
# not what its kind declares (axplug.api.kinds).
FAILURES = ("api", "conflict", "group", "missing", "import", "hang", "hooks", "kind")


def normalize(distribution: str) -> str:
    """A distribution name compared the way pip does (PEP 503): `Axplug_MoE` -> `axplug-moe`."""
    return re.sub(r"[-_.]+", "-", distribution).lower()


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

    @property
    def qualified_name(self) -> str:
        """`distribution:name`, unique even when two distributions share a name."""
        return f"{self.distribution}:{self.name}"

    @property
    def key(self) -> tuple[str, str, str]:
        return normalize(self.distribution), self.kind, self.name

    @property
    def first_party(self) -> bool:
        """Whether a distribution of this project provides it (see FIRST_PARTY)."""
        return normalize(self.distribution) in FIRST_PARTY

    @property
    def loadable(self) -> bool:
        """Whether `load` may import it (disabled and incompatible ones are never imported)."""
        return self.status not in ("disabled", "incompatible")

    def describe(self) -> str:
        return f"{self.kind} {self.name!r} from {self.distribution} {self.version} ({self.value})"


class ComponentNotFoundError(LookupError):
    """No component of that kind has that name."""


class ComponentUnavailableError(ComponentNotFoundError):
    """The component exists but is disabled or incompatible, so it is never imported."""


class ComponentConflictError(LookupError):
    """Several distributions provide the name; qualify it as `distribution:name`."""


class PluginLoadError(ImportError):
    """Importing a component failed; the failure is recorded and shown by `axplug list`."""

    def __init__(self, message: str, component: Component):
        super().__init__(message)
        self.component = component
