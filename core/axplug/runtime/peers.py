"""Lost-peer detection for multi-process runs: a heartbeat through jax's distributed key-value
store, and one line and `RESTART_EXIT_CODE` from every survivor when a peer stops beating.

Without it a survivor blocks in a collective with the dead process until the coordination
service's own heartbeat aborts it from C++ (a minute or more, and no word of which process
died or what is saved). Every process writes a counter under `axplug/heartbeat/<process>`
every `timeout_s / 10` seconds and reads everyone's; a peer whose counter has not moved for
0.8 `timeout_s` is lost, so a death is reported within `timeout_s` of it (the last beat and
its reading may each be an interval late). The coordinator process (0) hosts the store: when
it dies, the reads fail. The coordination service's own heartbeat timeout is set three times
longer (`service_heartbeat_timeout`), so this check fires first even on a loaded machine; a
failed read in process 0 itself is retried until it too is stale. One loss it cannot report: when
process 0 itself dies, jax's client in every survivor aborts the process from C++ within about
a second (SIGABRT, exit 134): jax 0.10 offers no way to take that error (its client's
`missed_heartbeat_callback` cannot be called from Python), so a scheduler must restart on any
non-zero exit, as the templates of `axplug launch --print` do.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
import time
from collections.abc import Callable

from axplug.runtime.exit_codes import RESTART_EXIT_CODE

__all__ = [
    "DEFAULT_PEER_TIMEOUT_S",
    "PeerMonitor",
    "await_lost_peer",
    "service_heartbeat_timeout",
    "start_peer_monitor",
    "stop_peer_monitor",
    "set_last_saved",
]


DEFAULT_PEER_TIMEOUT_S = 30.0
_PREFIX = "axplug/heartbeat/"
_DONE = "done"  # a process that ended on purpose: not lost
_monitor: PeerMonitor | None = None


def service_heartbeat_timeout(peer_timeout_s: float) -> int:
    """The coordination service's heartbeat timeout for a peer timeout: three times it, at least
    30 s more, so the service's abort (SIGABRT) is a backstop that axplug's own check beats even
    when a loaded machine delays the monitor's thread."""
    return int(max(3 * peer_timeout_s, peer_timeout_s + 30))


def _client():
    from jax._src import distributed

    return distributed.global_state.client


def _exit_lost(message: str) -> None:
    sys.stderr.write(f"error: {message}\n")
    sys.stderr.flush()
    logging.shutdown()
    os._exit(RESTART_EXIT_CODE)


class PeerMonitor:
    """A daemon thread watching the other processes' heartbeats; see the module docstring.

    `last_saved` returns the newest complete checkpoint step (or None), for the exit line.
    `on_lost(message)` ends the process (default: print `error: <message>`, exit 75)."""

    def __init__(
        self,
        timeout_s: float,
        last_saved: Callable[[], int | None] = lambda: None,
        *,
        on_lost: Callable[[str], None] = _exit_lost,
    ):
        import jax

        if timeout_s <= 0:
            raise ValueError(f"peer timeout must be > 0 seconds, got {timeout_s}")
        self.timeout_s = timeout_s
        self.interval_s = timeout_s / 10
        self._stale_s = timeout_s - 2 * self.interval_s
        self.last_saved = last_saved
        self._on_lost = on_lost
        self._me = jax.process_index()
        self._count = jax.process_count()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        # peer -> the poll before the one that saw its counter change: it beat after that time.
        self._beat_after: dict[int, float] = {}

    def start(self) -> PeerMonitor:
        if self._count > 1 and _client() is not None:
            self._thread = threading.Thread(target=self._run, name="axplug-peers", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        """Stops watching and tells the others this process ended on purpose."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.interval_s + 5)
            self._thread = None
            with contextlib.suppress(Exception):  # the store is gone: nobody left to tell
                _client().key_value_set(f"{_PREFIX}{self._me}", _DONE, allow_overwrite=True)

    def _run(self) -> None:
        client = _client()
        beat = 0
        start = answered = polled = time.monotonic()
        seen: dict[int, tuple[str, float]] = {}  # peer -> (counter, when it last changed)
        while not self._stop.wait(0 if beat == 0 else self.interval_s):
            beat += 1
            now = time.monotonic()
            try:
                client.key_value_set(f"{_PREFIX}{self._me}", str(beat), allow_overwrite=True)
                values = dict(client.key_value_dir_get(_PREFIX))
                answered = now
            except Exception as exc:  # the store lives in process 0
                if self._stop.is_set():
                    return
                first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
                if self._me != 0:
                    self._lost(0, f"the coordinator is unreachable ({first})")
                    return
                # In process 0 the store is in-process: a failed call is a slow machine, unless
                # it goes on failing (then the heartbeats of everyone are unknown).
                if now - answered > self._stale_s:
                    self._on_lost(
                        f"the coordination service in process 0 stopped answering ({first}). "
                        f"Exit {RESTART_EXIT_CODE}: restart every process with the same command"
                    )
                    return
                continue
            for peer in range(self._count):
                if peer == self._me:
                    continue
                value = values.get(f"{_PREFIX}{peer}")
                if value == _DONE:
                    self._beat_after[peer] = float("inf")
                    continue
                if value is None:  # not started yet: counts from our start
                    since = seen.get(peer, (None, start))[1]
                elif seen.get(peer, (None,))[0] != value:
                    seen[peer] = (value, now)
                    self._beat_after[peer] = polled
                    continue
                else:
                    since = seen[peer][1]
                if now - since > self._stale_s and not self._stop.is_set():
                    self._lost(peer, f"no heartbeat for {now - since:.1f} s")
                    return
            polled = now

    def await_verdict(self, since: float) -> None:
        """Returns once every peer has beaten (or ended on purpose) after `since`, or when the
        monitor has stopped (a lost peer ends the process first); at most the peer timeout."""
        deadline = since + self.timeout_s + self.interval_s
        peers = [p for p in range(self._count) if p != self._me]
        while time.monotonic() < deadline:
            thread = self._thread
            if thread is None or not thread.is_alive():
                return
            if all(self._beat_after.get(p, since) > since for p in peers):
                return
            thread.join(timeout=self.interval_s / 2)

    def _lost(self, peer: int, why: str) -> None:
        try:
            saved = self.last_saved()
        except Exception:  # the message matters more than the step
            saved = None
        where = f"step {saved}" if saved is not None else "none yet"
        self._on_lost(
            f"lost process {peer} of {self._count} ({why}); process {self._me} stops. "
            f"Newest complete checkpoint: {where}. Exit {RESTART_EXIT_CODE}: restart every "
            "process with the same command to resume"
        )


def start_peer_monitor(timeout_s: float) -> PeerMonitor:
    """Starts this process's monitor (one per process); a no-op with one process."""
    global _monitor
    stop_peer_monitor()
    _monitor = PeerMonitor(timeout_s).start()
    return _monitor


def set_last_saved(last_saved: Callable[[], int | None]) -> None:
    """What the lost-peer line reports as the newest complete checkpoint."""
    if _monitor is not None:
        _monitor.last_saved = last_saved


def await_lost_peer(exc: BaseException) -> None:
    """Before an error `exc` of a multi-process run is reported: waits until every peer has
    beaten since the error (the error is then this process's own) or the monitor names a lost
    peer (it then ends the process, exit 75), at most the peer timeout.

    A collective with a dead peer fails at once (gloo: connection reset), and so may a save or
    a read that waits on it, before its heartbeats go stale; reported as such, the process
    would then hang in jax's shutdown barrier until the coordination service aborts it."""
    monitor = _monitor
    if monitor is not None and isinstance(exc, Exception):
        monitor.await_verdict(time.monotonic())


def stop_peer_monitor() -> None:
    """Stops the monitor, marking this process as ended on purpose."""
    global _monitor
    if _monitor is not None:
        _monitor.stop()
        _monitor = None
