"""One trainer (or standby) subprocess: its output passed through line by line, its step
lines noticed, so a supervisor can tell when a restarted run completes its first step.

A child never depends on its supervisor staying alive: it writes its output to a file (which
the supervisor follows), not to a pipe that would fill and block it once no one reads, and
on Linux it gets SIGTERM when the supervisor dies (`PR_SET_PDEATHSIG`): a trainer then saves
and exits 75, releasing the run's lease, instead of living on unwatched."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TextIO

__all__ = ["Child", "describe_exit"]

# What `axplug train` prints (process 0 only): "step 5/8 loss 6.2 ..." and, on a resume,
# "resumed from step 4 of DIR".
_STEP = re.compile(r"^step (\d+)/")
_RESUMED = re.compile(r"resumed from step (\d+)")


def describe_exit(code: int) -> str:
    """`exit 75` or `signal SIGKILL`, from a Popen return code."""
    if code < 0:
        try:
            return f"signal {signal.Signals(-code).name}"
        except ValueError:
            return f"signal {-code}"
    return f"exit {code}"


class Child:
    """A subprocess whose merged stdout/stderr goes to `out`, each line after `prefix`."""

    def __init__(
        self,
        argv: Sequence[str],
        *,
        env: Mapping[str, str],
        out: TextIO,
        prefix: str = "",
        lock: threading.Lock | None = None,
        log_path: str,
    ):
        self.argv = list(argv)
        self.started_at = time.time()
        self.first_step: int | None = None
        self.first_step_at: float | None = None
        self.last_step: int | None = None
        self.resumed_from: int | None = None
        self._out, self._prefix = out, prefix
        self._lock = lock or threading.Lock()
        os.makedirs(os.path.dirname(os.path.abspath(log_path)), exist_ok=True)
        self.log_path = log_path
        with open(log_path, "ab") as log:
            self._offset = log.tell()
            # Its own session: a Ctrl-C in the supervisor's terminal reaches the children only
            # through the supervisor, which decides what each of them gets.
            self.proc = subprocess.Popen(
                self.argv,
                env=dict(env),
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
                preexec_fn=_dies_with(os.getpid()),  # noqa: PLW1509 - prctl before exec only
            )
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    @property
    def pid(self) -> int:
        return self.proc.pid

    def _read(self) -> None:
        """Follows the child's log file until the child has exited and all of it is read."""
        with open(self.log_path, encoding="utf-8", errors="replace") as log:
            log.seek(self._offset)
            partial = ""
            while True:
                exited = self.proc.poll() is not None  # before reading: then nothing is missed
                while chunk := log.readline():
                    partial += chunk
                    if partial.endswith("\n"):
                        self._line(partial)
                        partial = ""
                if exited:
                    if partial:
                        self._line(partial + "\n")
                    return
                time.sleep(0.05)

    def _line(self, line: str) -> None:
        if (match := _STEP.match(line)) is not None:
            step = int(match.group(1))
            if self.first_step is None:
                self.first_step, self.first_step_at = step, time.time()
            self.last_step = step
        elif (match := _RESUMED.search(line)) is not None:
            self.resumed_from = int(match.group(1))
        with self._lock:
            self._out.write(self._prefix + line)
            self._out.flush()

    def poll(self) -> int | None:
        return self.proc.poll()

    def send(self, sig: int) -> None:
        """Sends `sig` unless the process has already exited."""
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(sig)

    def stop(self, grace_s: float) -> int:
        """SIGTERM, up to `grace_s` seconds to exit, then SIGKILL; returns the exit code."""
        self.send(signal.SIGTERM)
        try:
            return self.wait(grace_s)
        except subprocess.TimeoutExpired:
            self.send(signal.SIGKILL)
            return self.wait(None)

    def kill(self) -> int:
        self.send(signal.SIGKILL)
        return self.wait(None)

    def wait(self, timeout: float | None) -> int:
        code = self.proc.wait(timeout)
        self._reader.join(5)  # the rest of its output, before the caller prints more
        return code


def _dies_with(parent: int) -> Callable[[], None] | None:
    """A `preexec_fn` that asks Linux for SIGTERM when `parent` dies (None elsewhere)."""
    if not sys.platform.startswith("linux"):
        return None

    def set_up() -> None:
        import ctypes

        ctypes.CDLL(None).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
        if os.getppid() != parent:  # it died before the call: nobody would signal
            os.kill(os.getpid(), signal.SIGTERM)

    return set_up
