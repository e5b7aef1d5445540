"""Keeps a failed background save to its one-line cause.

When an Orbax write fails (a full disk, a store that went away), its background threads log the
error from each writer thread, TensorStore's callbacks find their asyncio loop closed, and the
unfinished write coroutines are reported again when Python shuts down: 150-225 tracebacks for
one cause. The Checkpointer raises that cause itself (CheckpointError), so these echoes are
dropped: Orbax's own ERROR records, and, once a save has failed, the abandoned-coroutine
reports of Orbax and TensorStore code. Nothing else is touched. TensorStore's C++ callbacks
print their "Event loop is closed" tracebacks themselves, past Python's hooks: those remain.
"""

from __future__ import annotations

import logging
import sys
import threading

__all__ = ["drop_orbax_error_logs", "quiet_after_failed_save"]

_installed = threading.Event()


class _OrbaxErrors(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.levelno >= logging.ERROR and "/orbax/" in record.pathname)


def drop_orbax_error_logs() -> None:
    """Orbax's ERROR records repeat a failure the Checkpointer raises with its cause."""
    logger = logging.getLogger("absl")
    if not any(isinstance(f, _OrbaxErrors) for f in logger.filters):
        logger.addFilter(_OrbaxErrors())


def _from_checkpoint_io(code_file: str) -> bool:
    return any(part in code_file for part in ("/orbax/", "/tensorstore/"))


def quiet_after_failed_save() -> None:
    """Drop the echoes of a failed save: the write coroutines it abandoned."""
    if _installed.is_set():
        return
    _installed.set()
    previous = sys.unraisablehook

    def unraisable(info) -> None:
        code = getattr(info.object, "cr_code", None)
        if code is not None and _from_checkpoint_io(code.co_filename):
            return
        previous(info)

    sys.unraisablehook = unraisable
