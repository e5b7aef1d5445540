"""Compiling the train step: the persistent XLA cache, and compiling ahead of the first call
with the time it took and whether the cache answered."""

from __future__ import annotations

import contextlib
import os
import time
from typing import Any

import jax

__all__ = ["enable_compilation_cache", "compile_ahead"]


def enable_compilation_cache(directory: str) -> None:
    """Persist compiled XLA programs in `directory` so a rerun skips compilation."""
    path = os.path.expanduser(directory)
    os.makedirs(path, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    # The op names (each module's named scope) and source locations are part of the key: an
    # entry of the same program traced under other names would otherwise answer, and a
    # profile or an HLO dump would show that compile's names.
    jax.config.update("jax_compilation_cache_include_metadata_in_key", True)


@contextlib.contextmanager
def _cache_events():
    """The names of the persistent compilation cache's events recorded inside the block."""
    events: set[str] = set()

    def listener(event: str, **_: Any) -> None:
        if event.startswith("/jax/compilation_cache/"):
            events.add(event)

    jax.monitoring.register_event_listener(listener)
    try:
        yield events
    finally:
        jax.monitoring.unregister_event_listener(listener)


def compile_ahead(jitted, *args) -> tuple[float, str]:
    """Compiles `jitted` for `args` (filling the cache its first call uses); (seconds, what the
    persistent cache did: a hit, a miss, or nothing)."""
    start = time.perf_counter()
    with _cache_events() as events:
        jitted.lower(*args).compile()
    if "/jax/compilation_cache/cache_hits" in events:
        cache = "a persistent-cache hit"
    elif "/jax/compilation_cache/cache_misses" in events:
        cache = "a persistent-cache miss, now cached"
    else:
        cache = "no persistent cache"
    return time.perf_counter() - start, cache
