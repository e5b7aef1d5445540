"""Compiling the train step: the persistent XLA cache (in a scope that restores the process's
settings), and compiling ahead of the first call with the time it took and whether the cache
answered."""

from __future__ import annotations

import contextlib
import os
import time
from typing import Any

import jax

from axplug.paths import CACHE, cache_path

__all__ = ["DEFAULT_CACHE_DIR", "cache_dir_for", "compilation_cache", "compile_ahead"]

DEFAULT_CACHE_DIR = f"{CACHE}/xla"  # the Trainer's; $AXPLUG_CACHE/xla when that is set


def cache_dir_for(directory: str | None) -> str | None:
    """Where `compilation_cache(directory)` persists programs; None: the process's own settings
    (for None, and for the default directory when the environment names jax's cache with
    `JAX_COMPILATION_CACHE_DIR`: a test session's, a cluster's shared cache)."""
    if not directory or (
        directory == DEFAULT_CACHE_DIR and os.environ.get("JAX_COMPILATION_CACHE_DIR")
    ):
        return None
    return cache_path(directory)


@contextlib.contextmanager
def compilation_cache(directory: str | None):
    """Persists compiled programs in `cache_dir_for(directory)` inside the block, then restores
    the process's own settings; None leaves them as they are (jax's defaults, or the
    environment's)."""
    directory = cache_dir_for(directory)
    wanted: dict[str, Any] = {}
    if directory:
        wanted = {
            "jax_compilation_cache_dir": directory,
            "jax_persistent_cache_min_compile_time_secs": 0.0,
            "jax_persistent_cache_min_entry_size_bytes": 0,
            # Op names (each module's named scope) and source locations in the key: an entry of
            # the same program traced under other names would otherwise answer, and a profile or
            # an HLO dump would show that compile's names.
            "jax_compilation_cache_include_metadata_in_key": True,
        }
    before = {name: getattr(jax.config, name) for name in wanted}
    if before == wanted:
        yield
        return
    from jax.experimental.compilation_cache import compilation_cache as cache

    os.makedirs(wanted["jax_compilation_cache_dir"], exist_ok=True)
    try:
        _apply(wanted, cache)
        yield
    finally:
        _apply(before, cache)


def _apply(settings: dict[str, Any], cache: Any) -> None:
    for name, value in settings.items():
        jax.config.update(name, value)
    cache.reset_cache()  # jax opens its cache once per process: reopen it where it now points


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
