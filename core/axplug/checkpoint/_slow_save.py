"""A save that blocks its caller too long says so once: a frozen object store or a full, slow
disk otherwise looks like a hung run."""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Iterator

__all__ = ["SLOW_SAVE_WARNING_S", "warn_if_slow"]

log = logging.getLogger("axplug.checkpoint")

SLOW_SAVE_WARNING_S = 30.0


@contextlib.contextmanager
def warn_if_slow(url: str, step: int, doing: str) -> Iterator[None]:
    """Logs once if the block takes longer than `SLOW_SAVE_WARNING_S` (while it runs)."""
    started = time.monotonic()
    done = threading.Event()

    def warn() -> None:
        if not done.wait(SLOW_SAVE_WARNING_S):
            log.warning(
                "%s step %d to %s: still writing after %.0f s; the storage is slow or not "
                "answering (a frozen object store, a full disk?)",
                doing,
                step,
                url,
                time.monotonic() - started,
            )

    watcher = threading.Thread(target=warn, name="axplug-slow-save", daemon=True)
    watcher.start()
    try:
        yield
    finally:
        done.set()
        watcher.join()
