"""One thread that owns the Engine: requests and cancellations in, tokens and completions out."""

from __future__ import annotations

import collections
import concurrent.futures
import logging
import threading
from collections.abc import Callable
from typing import Any

from axplug.api import AxplugError
from axplug.api.run import Completion, Engine, Request, TokenEvent

__all__ = ["EngineWorker", "QueueFullError", "Sink"]

log = logging.getLogger("axplug.serve")

# What a request's sink receives, in the worker thread: its TokenEvents, then its Completion,
# or an exception (a request the engine refused, or a failed step).
Sink = Callable[[TokenEvent | Completion | BaseException], None]


class QueueFullError(AxplugError, RuntimeError):
    """Every cache row is busy and the waiting queue is full."""


class EngineWorker:
    """Runs `engine` in a background thread, so HTTP handlers never block on JAX.

    At most `engine.num_slots + max_waiting` requests are in flight; `submit` refuses more
    with `QueueFullError` instead of queueing without bound. `on_step(engine)` runs after
    every engine step and cancellation (metrics).
    """

    def __init__(
        self,
        engine: Engine,
        *,
        max_waiting: int,
        on_step: Callable[[Engine], None] | None = None,
    ):
        if max_waiting < 0:
            raise ValueError(f"max_waiting={max_waiting} must be >= 0")
        self.engine = engine
        self.capacity = engine.num_slots + max_waiting
        self.error: BaseException | None = None  # the failure that stopped the thread
        self._on_step = on_step
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._inbox: collections.deque[tuple[str, Any, Any]] = collections.deque()
        self._sinks: dict[Any, Sink] = {}
        self._in_flight = 0
        self._stopping = False
        self._thread = threading.Thread(target=self._loop, name="axplug-engine", daemon=True)

    @property
    def in_flight(self) -> int:
        """Requests submitted and not yet finished."""
        return self._in_flight

    @property
    def healthy(self) -> bool:
        return self.error is None and self._thread.is_alive()

    def start(self) -> None:
        if self._on_step is not None:  # metrics right from the start, not after a request
            self._on_step(self.engine)
        self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        """Stops after the current step; requests still in flight get a RuntimeError."""
        self._stopping = True
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout)
        close = getattr(self.engine, "close", None)  # a disaggregated engine's prefill thread
        if close is not None:
            close()

    def submit(self, request: Request, sink: Sink) -> None:
        """Queues `request`; `sink` gets its tokens. QueueFullError when at capacity."""
        self.submit_all([(request, sink)])

    def submit_all(self, requests: list[tuple[Request, Sink]]) -> None:
        """Queues every request or none: QueueFullError when they do not all fit now."""
        with self._lock:
            if self.error is not None or self._stopping:
                raise RuntimeError(f"the engine is not running: {self.error or 'stopping'}")
            if self._in_flight + len(requests) > self.capacity:
                slots = self.engine.num_slots
                raise QueueFullError(
                    f"the server is at capacity: {self._in_flight} requests in flight "
                    f"({slots} decoding at once, {self.capacity - slots} queued) and this "
                    f"one needs {len(requests)}; retry later"
                )
            self._in_flight += len(requests)
            self._inbox.extend(("submit", request, sink) for request, sink in requests)
        self._wake.set()

    def cancel(self, request_id: Any) -> None:
        """Drops a request (a client went away); its sink still gets its Completion."""
        with self._lock:
            self._inbox.append(("cancel", request_id, None))
        self._wake.set()

    def call(self, fn: Callable[[Engine], Any]) -> concurrent.futures.Future:
        """Runs `fn(engine)` in the worker thread between two steps (after the requests
        submitted before it are in the engine); the future holds its result or exception."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            if self.error is not None or self._stopping:
                raise RuntimeError(f"the engine is not running: {self.error or 'stopping'}")
            self._inbox.append(("call", fn, future))
        self._wake.set()
        return future

    # -- the worker thread -------------------------------------------------------------------

    def _loop(self) -> None:
        try:
            while not self._stopping:
                self._wake.wait()
                self._wake.clear()
                self._drain()
                while self.engine.has_work and not self._stopping:
                    events = self.engine.step()
                    for event in events:
                        self._send(event.id, event)
                    self._deliver_finished()
                    self._drain()
        except BaseException as exc:  # noqa: BLE001 -- reported to every waiting client
            log.exception("the engine failed; every request in flight ends with an error")
            self.error = exc
        failure = self.error or RuntimeError("the server is shutting down")
        with self._lock:
            sinks, self._sinks = self._sinks, {}
            pending = [sink for op, _, sink in self._inbox if op == "submit" and sink]
            calls = [future for op, _, future in self._inbox if op == "call"]
            self._inbox.clear()
            self._in_flight = 0
        for sink in [*sinks.values(), *pending]:
            sink(failure)
        for future in calls:
            future.set_exception(failure)

    def _drain(self) -> None:
        while True:
            with self._lock:
                if not self._inbox:
                    break
                op, item, sink = self._inbox.popleft()
            if op == "cancel" or sink is None:
                self.engine.cancel(item)
                continue
            if op == "call":
                try:
                    sink.set_result(item(self.engine))
                except Exception as exc:  # noqa: BLE001 -- the caller's to report
                    sink.set_exception(exc)
                continue
            try:
                self.engine.submit(item)
            # Checked by the server first; the engine has the last word. Whatever it refuses
            # fails this request only, never the engine.
            except Exception as exc:  # noqa: BLE001
                if not isinstance(exc, ValueError):
                    log.exception("request %r could not be queued", item.id)
                self._release()
                sink(exc)
            else:
                self._sinks[item.id] = sink
        self._deliver_finished()

    def _deliver_finished(self) -> None:
        for completion in self.engine.pop_finished():
            sink = self._sinks.pop(completion.id, None)
            self._release()
            if sink is not None:
                sink(completion)
        if self._on_step is not None:
            self._on_step(self.engine)

    def _send(self, request_id: Any, item: TokenEvent) -> None:
        sink = self._sinks.get(request_id)
        if sink is not None:
            sink(item)

    def _release(self) -> None:
        with self._lock:
            self._in_flight -= 1
