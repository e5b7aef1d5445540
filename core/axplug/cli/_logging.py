"""The CLI's log output: axplug's own records on stderr, whatever else configured the root."""

from __future__ import annotations

import logging
import sys

__all__ = ["configure_logging"]

_FORMAT = "%(levelname)s %(name)s: %(message)s"


class _Handler(logging.StreamHandler):
    """Writes to the `sys.stderr` of the moment (a test's capture, a redirected stream)."""

    def __init__(self):
        super().__init__(sys.stderr)

    def emit(self, record: logging.LogRecord) -> None:
        self.stream = sys.stderr
        super().emit(record)


def configure_logging(verbosity: int = 0) -> None:
    """INFO and up from the `axplug` loggers on stderr (DEBUG with verbosity 1, WARNING with
    -1, ERROR with -2). A handler of its own on `axplug`, not `logging.basicConfig`: JAX and
    absl configure the root logger on import, which makes basicConfig do nothing."""
    level = {-2: logging.ERROR, -1: logging.WARNING, 0: logging.INFO}.get(
        max(verbosity, -2), logging.DEBUG
    )
    logger = logging.getLogger("axplug")
    for handler in [h for h in logger.handlers if isinstance(h, _Handler)]:
        logger.removeHandler(handler)
    handler = _Handler()
    handler.setFormatter(logging.Formatter(_FORMAT))
    logger.addHandler(handler)
    logger.setLevel(level)
    logger.propagate = False  # the root's handlers (absl's) would print each record again
    logging.getLogger("absl").setLevel(logging.WARNING)  # orbax logs every file it writes
