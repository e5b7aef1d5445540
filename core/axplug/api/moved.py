"""Old import paths of names that moved in plugin API 1.4, kept for one minor release."""

from __future__ import annotations

import importlib
import warnings
from collections.abc import Callable
from typing import Any

__all__ = ["moved_names"]


def moved_names(module: str, moved: dict[str, str]) -> Callable[[str], Any]:
    """A module `__getattr__` serving `moved` (name -> new module) with a DeprecationWarning.

    The new module is imported by name when an old name is first read, which is the one
    place a lower room reaches a higher one: only for a caller still on the old path.
    """

    def __getattr__(name: str) -> Any:
        if name not in moved:
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        warnings.warn(
            f"{module}.{name} moved to {moved[name]}.{name} (plugin API 1.4); import it from "
            "there: the old path goes with plugin API 2",
            DeprecationWarning,
            stacklevel=2,
        )
        return getattr(importlib.import_module(moved[name]), name)

    return __getattr__
