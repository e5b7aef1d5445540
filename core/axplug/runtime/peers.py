"""Lost-peer detection for multi-process runs: a heartbeat through jax's distributed key-value
store, and one line and `RESTART_EXIT_CODE` from every survivor when a peer stops beating.

Without it a survivor blocks in a collective with the dead process until the coordination
service's own heartbeat aborts it from C++ (a minute or more, and no word of which process
died or what is saved). Every process writes a counter under `axplug/heartbeat/<process>`
every `timeout_s / 10` seconds and reads everyone's; a peer whose counter has not moved for
0.8 `timeout_s` is lost, so a death is reported within `timeout_s` of it (the last beat and
its reading may each be an interval late). The coordinator process (0) hosts the store: when
it dies, the reads fail. The coordination service's own heartbeat timeout is set longer
(`service_heartbeat_timeout`), so this check fires first. One loss it cannot report: when
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
    """The coordination service's heartbeat timeout for a peer timeout: twice it, at least 10 s
    more, so the service's abort is a backstop that axplug's own check always beats."""
    return int(max(2 * peer_timeout_s, peer_timeout_s + 10))


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
        start = time.monotonic()
        seen: dict[int, tuple[str, float]] = {}  # process -> (counter, when it last changed)
        while not self._stop.wait(0 if beat == 0 else self.interval_s):
            beat += 1
            now = time.monotonic()
            try:
                client.key_value_set(f"{_PREFIX}{self._me}", str(beat), allow_overwrite=True)
                values = dict(client.key_value_dir_get(_PREFIX))
            except Exception as exc:  # the store lives in process 0
                if self._stop.is_set():
                    return
                if self._me == 0:
                    raise
                self._lost(0, f"the coordinator is unreachable ({str(exc).splitlines()[0]})")
                return
            for peer in range(self._count):
                if peer == self._me:
                    continue
                value = values.get(f"{_PREFIX}{peer}")
                if value == _DONE:
                    continue
                if value is None:  # not started yet: counts from our start
                    since = seen.get(peer, (None, start))[1]
                elif seen.get(peer, (None,))[0] != value:
                    seen[peer] = (value, now)
                    continue
                else:
                    since = seen[peer][1]
                if now - since > self._stale_s and not self._stop.is_set():
                    self._lost(peer, f"no heartbeat for {now - since:.1f} s")
                    return

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
    """Before a device error `exc` of a multi-process run is reported: waits up to the peer
    timeout for the monitor to name a lost peer (it then ends the process, exit 75).

    A collective with a dead peer fails at once (gloo: connection reset), before its
    heartbeats go stale; reported as such, the process would then hang in jax's shutdown
    barrier until the coordination service aborts it (SIGABRT)."""
    import jax

    monitor = _monitor
    thread = None if monitor is None else monitor._thread
    if thread is not None and isinstance(exc, jax.errors.JaxRuntimeError):
        thread.join(timeout=monitor.timeout_s + monitor.interval_s)


def stop_peer_monitor() -> None:
    """Stops the monitor, marking this process as ended on purpose."""
    global _monitor
    if _monitor is not None:
        _monitor.stop()
        _monitor = None
