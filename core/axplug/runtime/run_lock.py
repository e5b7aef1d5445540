"""An exclusive lease on a run directory, so two trainers never write into one.

Process 0 of a run holds an `fcntl.flock` on `DIR/.axplug-lock` while it trains; the file
holds the holder's host, PID, start time and command for the message a second run gets. The
kernel drops the lock when its process dies, however it dies (SIGKILL, OOM), so a dead run's
lease is never stale: the next run takes it over. The lease is per process and re-entrant
(`train()` holds it around writing config.txt and the run; two trainers built one after the
other in one process share it).
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import sys
import threading
import time

from axplug.config import ConfigError

__all__ = ["RunDirLock", "RunDirLockedError", "LOCK_FILE"]

LOCK_FILE = ".axplug-lock"

_held: dict[str, list[int]] = {}  # lock path -> [fd, depth], this process's leases
_guard = threading.Lock()


class RunDirLockedError(ConfigError):
    """Another live run holds the run directory."""


class RunDirLock:
    """`with RunDirLock(directory):` holds the run directory's lease (see module docstring)."""

    def __init__(self, directory: str):
        self.directory = directory
        self.path = os.path.join(os.path.realpath(os.path.expanduser(directory)), LOCK_FILE)

    def acquire(self) -> None:
        """Takes the lease, or raises RunDirLockedError naming the run that holds it."""
        with _guard:
            if self.path in _held:
                _held[self.path][1] += 1
                return
            os.makedirs(os.path.dirname(self.path), exist_ok=True)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                holder = _describe(_read(fd))
                os.close(fd)
                raise RunDirLockedError(
                    f"output_dir {self.directory} is in use by another run ({holder}); two runs "
                    "in one directory overwrite each other's checkpoints and metrics. Stop that "
                    "run, or train into another --output-dir"
                ) from None
            previous = _read(fd)
            os.ftruncate(fd, 0)
            os.pwrite(fd, json.dumps(_me()).encode(), 0)
            _held[self.path] = [fd, 1]
        if previous.get("pid"):
            # The kernel released a lease whose process died without releasing it.
            import logging

            logging.getLogger("axplug.trainer").warning(
                "taking over output_dir %s from a run that ended without releasing it (%s)",
                self.directory,
                _describe(previous),
            )

    def release(self) -> None:
        """Gives the lease back once every acquire in this process is matched."""
        with _guard:
            entry = _held.get(self.path)
            if entry is None:
                return
            entry[1] -= 1
            if entry[1] > 0:
                return
            del _held[self.path]
            fd = entry[0]
            os.ftruncate(fd, 0)  # a released lease names no holder
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)

    def __enter__(self) -> RunDirLock:
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def _me() -> dict:
    return {
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "command": " ".join(sys.argv)[:500],
    }


def _read(fd: int) -> dict:
    try:
        return json.loads(os.pread(fd, 4096, 0).decode() or "{}")
    except (ValueError, OSError):
        return {}


def _describe(info: dict) -> str:
    if not info:
        return "holder unknown"
    return (
        f"pid {info.get('pid')} on {info.get('host')}, started {info.get('started')}: "
        f"{info.get('command') or '?'}"
    )
