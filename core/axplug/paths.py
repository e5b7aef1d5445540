"""Where axplug keeps its caches: `~/.cache/axplug`, or `$AXPLUG_CACHE` when set (a shared
cache disk; the test session sets one of its own, so tests never touch the user's)."""

from __future__ import annotations

import os

__all__ = ["CACHE", "cache_path"]

CACHE = "~/.cache/axplug"  # as defaults and docs spell it


def cache_path(path: str) -> str:
    """`path` with `~` expanded, and a leading `~/.cache/axplug` moved to `$AXPLUG_CACHE`
    (else to `$XDG_CACHE_HOME/axplug`) when that is set."""
    if path == CACHE or path.startswith(CACHE + "/"):
        xdg = os.environ.get("XDG_CACHE_HOME")
        root = os.environ.get("AXPLUG_CACHE") or (os.path.join(xdg, "axplug") if xdg else CACHE)
        path = root + path[len(CACHE) :]
    return os.path.expanduser(path)
