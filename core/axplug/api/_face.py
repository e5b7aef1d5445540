"""How a face of the plugin API re-exports core modules without importing them up front."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable
from typing import Any

__all__ = ["face", "lazy"]


def face(name: str, *sources: str | tuple[str, tuple[str, ...]]) -> Callable[[str], Any]:
    """The module `__getattr__` of the face `name`: each source is a core module (all of its
    `__all__`) or `(module, names)`; a name is looked up in them in order, importing each only
    when reached, so `from axplug.api.config import config_class` never imports the trainer."""

    def exported(source: str | tuple[str, tuple[str, ...]]) -> tuple[Any, tuple[str, ...]]:
        module, names = (source, None) if isinstance(source, str) else source
        imported = importlib.import_module(module)
        return imported, tuple(imported.__all__ if names is None else names)

    def __getattr__(attr: str) -> Any:
        if attr == "__all__":
            return [n for source in sources for n in exported(source)[1]]
        if attr.startswith("__"):  # `__path__`, `__wrapped__`...: the import system's probes
            raise AttributeError(attr)
        for source in sources:
            module, names = exported(source)
            if attr in names:
                value = sys.modules[name].__dict__[attr] = getattr(module, attr)
                return value
        raise AttributeError(f"module {name!r} has no attribute {attr!r}")

    return __getattr__


def lazy(name: str, homes: dict[str, str]) -> Callable[[str], Any]:
    """The module `__getattr__` of package `name` whose names live in other modules (`homes`:
    name -> module, relative to `name` when it has no dot), each imported on first use."""

    def __getattr__(attr: str) -> Any:
        if attr not in homes:
            raise AttributeError(f"module {name!r} has no attribute {attr!r}")
        home = homes[attr] if "." in homes[attr] else f"{name}.{homes[attr]}"
        value = sys.modules[name].__dict__[attr] = getattr(importlib.import_module(home), attr)
        return value

    return __getattr__
