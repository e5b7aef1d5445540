"""Plugin registry: discover components from entry points, load them lazily, run hooks."""

from axplug.registry._component import (
    FAILURES,
    FIRST_PARTY_ENTRY,
    KINDS,
    STATUSES,
    SUPPORTED_PLUGIN_API,
    Component,
    ComponentConflictError,
    ComponentNotFoundError,
    ComponentUnavailableError,
    PluginLoadError,
)
from axplug.registry._describe import describe, first_sentence
from axplug.registry._discovery import ALLOW_ENV, DISABLE_ENV, discover
from axplug.registry._hooks import plugin_manager
from axplug.registry._kinds import check_kind
from axplug.registry._loading import (
    conformed,
    entry,
    load,
    load_as,
    load_within,
    names,
    reset,
    shadowing_first_party,
)

__all__ = [
    "conformed",
    "load_as",
    "FIRST_PARTY_ENTRY",
    "KINDS",
    "STATUSES",
    "FAILURES",
    "SUPPORTED_PLUGIN_API",
    "DISABLE_ENV",
    "ALLOW_ENV",
    "Component",
    "ComponentNotFoundError",
    "ComponentUnavailableError",
    "ComponentConflictError",
    "PluginLoadError",
    "check_kind",
    "discover",
    "describe",
    "first_sentence",
    "names",
    "entry",
    "load",
    "load_within",
    "plugin_manager",
    "reset",
    "shadowing_first_party",
]
