"""An exclusive lease on a run directory, so two trainers never write into one.

Process 0 of a run holds an `fcntl.flock` on `DIR/.axplug-lock` while it trains; the file
holds the holder's host, PID, start time and command for the message a second run gets. The
kernel drops the lock when its process dies, however it dies (SIGKILL, OOM), so a dead run's
lease is never stale: the next run takes it over. The lease is per process and re-entrant
(`train()` holds it around writing config.txt and the run; two trainers built one after the
other in one process share it). A run directory in an object store has no locks: `StoreLease`
keeps a renewed lease object there instead.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import socket
import sys
import threading
import time

from axplug.config import ConfigError

__all__ = ["RunDirLock", "StoreLease", "RunDirLockedError", "LOCK_FILE", "LEASE_OBJECT"]

LOCK_FILE = ".axplug-lock"
LEASE_OBJECT = ".axplug-lease.json"

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


class StoreLease:
    """The same lease for a run directory in an object store (`s3://`, `gs://`), which has no
    locks: `DIR/.axplug-lease.json` names the holder and when it last renewed the lease (every
    `ttl_s / 4` from a thread). A lease renewed within `ttl_s` is live. Acquiring waits up to
    `ttl_s` for a live one to lapse (a killed run's, when its job restarts at once) and is
    refused if it keeps being renewed; after writing its own record it reads it back after
    `settle_s`, so of two runs starting together one sees the other's and stands down.
    """

    def __init__(self, storage, directory: str, *, ttl_s: float = 60.0, settle_s: float = 1.0):
        self.storage, self.directory = storage, directory
        self.url = storage.join(directory, LEASE_OBJECT)
        self.ttl_s, self.settle_s = ttl_s, settle_s
        self.token = f"{socket.gethostname()}:{os.getpid()}:{time.time_ns()}"
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _read(self) -> dict:
        """The lease record, {} when there is none; a store error propagates (never "free")."""
        try:
            text = self.storage.read_text(self.url)
        except FileNotFoundError:
            return {}
        try:
            return json.loads(text)
        except ValueError:
            raise RunDirLockedError(
                f"{self.url}: not a lease record; delete it if no run trains in {self.directory}"
            ) from None

    def _write(self) -> None:
        self.storage.write_text(
            self.url, json.dumps({**_me(), "token": self.token, "renewed": time.time()})
        )

    def acquire(self) -> None:
        """Takes the lease, or raises RunDirLockedError naming the live run that holds it."""
        deadline = time.monotonic() + self.ttl_s
        while (held := self._read()) and time.time() - held.get("renewed", 0) < self.ttl_s:
            if time.monotonic() > deadline:
                raise RunDirLockedError(
                    f"output_dir {self.directory} is in use by another run ({_describe(held)}), "
                    f"which renewed its lease {time.time() - held['renewed']:.0f} s ago; stop "
                    "that run, or train into another --output-dir"
                )
            time.sleep(min(self.ttl_s / 8, 5.0))
        self._write()
        time.sleep(self.settle_s)
        if (held := self._read()).get("token") != self.token:
            raise RunDirLockedError(
                f"output_dir {self.directory} was taken by another run starting at the same "
                f"time ({_describe(held)}); train into another --output-dir"
            )
        self._stop.clear()
        self._thread = threading.Thread(target=self._renew, name="axplug-lease", daemon=True)
        self._thread.start()

    def _renew(self) -> None:
        while not self._stop.wait(self.ttl_s / 4):
            try:
                held = self._read()
            except Exception:  # noqa: BLE001 - a store hiccup: try again at the next renewal
                continue
            if held.get("token") != self.token:
                msg = "the lease on %s was deleted or taken by another run; two may write there"
                return logging.getLogger("axplug.trainer").error(msg, self.directory)
            try:
                self._write()
            except Exception:  # noqa: BLE001 - as above
                continue

    def release(self) -> None:
        """Stops renewing and deletes the lease record if it is still this run's."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
            try:
                if self._read().get("token") == self.token:
                    self.storage.delete(self.url)
            except Exception:  # noqa: BLE001 - an unreleased lease lapses after ttl_s
                pass

    def __enter__(self) -> StoreLease:
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
