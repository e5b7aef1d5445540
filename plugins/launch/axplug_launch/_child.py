"""One trainer (or standby) subprocess: its output passed through line by line, its step
lines noticed, so a supervisor can tell when a restarted run completes its first step."""

from __future__ import annotations

import contextlib
import re
import signal
import subprocess
import threading
import time
from collections.abc import Mapping, Sequence
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
    ):
        self.argv = list(argv)
        self.started_at = time.time()
        self.first_step: int | None = None
        self.first_step_at: float | None = None
        self.last_step: int | None = None
        self.resumed_from: int | None = None
        self._out, self._prefix = out, prefix
        self._lock = lock or threading.Lock()
        # Its own session: a Ctrl-C in the supervisor's terminal reaches the children only
        # through the supervisor, which decides what each of them gets.
        self.proc = subprocess.Popen(
            self.argv,
            env=dict(env),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            text=True,
            bufsize=1,
            start_new_session=True,
        )
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    @property
    def pid(self) -> int:
        return self.proc.pid

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
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
