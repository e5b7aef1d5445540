"""Prefill/decode disaggregation: prompts prefilled by one Engine, decoded by another.

The two engines sit on different device sets (meshes) and run at the same time: the prefill
engine in a thread of its own (JAX releases the GIL while devices compute), the decode engine
in the caller's `step()`. A long prefill therefore never delays the decode steps of other
requests, and each side is sized for its own work. A request is prefilled (and gets its first
token) in the prefill engine; its cached row is then read out in a layout-free form
(the cache's `read_row`), moved by a `KVTransfer` and written into a free row (and
pages) of the decode engine, where it decodes to the end.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import jax

from axplug.api.run import Completion, Engine, Request, RequestState, TokenEvent, run_to_completion

__all__ = ["KVTransfer", "DevicePutTransfer", "DisaggregatedEngine"]


class KVTransfer(Protocol):
    """Moves a prefilled row (a pytree of arrays) to the decode engine's devices.

    `DevicePutTransfer` does it within a process; a multi-host deployment implements the
    same method over its network (send the arrays, `device_put` them on the receiving side).
    """

    def transfer(self, row: Any, mesh: jax.sharding.Mesh | None) -> Any: ...


class DevicePutTransfer:
    """`jax.device_put` onto the decode engine's mesh (replicated; the cache write reshards)."""

    def transfer(self, row: Any, mesh: jax.sharding.Mesh | None) -> Any:
        if mesh is None:
            return row
        return jax.device_put(row, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))


class DisaggregatedEngine:
    """`prefill` caches prompts and samples first tokens; `decode` does the rest.

    Same interface as `Engine` (`submit`, `step`, `run`, `pop_finished`, `cancel`) and the
    same tokens: sampling keys depend only on a request's seed and token index. A request
    enters the prefill engine only when a decode row is free for it, so prefilled rows never
    pile up. With `threaded=False` each `step()` runs a prefill step, then a decode step.
    """

    def __init__(
        self,
        prefill: Engine,
        decode: Engine,
        *,
        transfer: KVTransfer | None = None,
        decode_mesh: jax.sharding.Mesh | None = None,
        threaded: bool = True,
    ):
        if prefill.max_len != decode.max_len:
            raise ValueError(
                f"the prefill engine's max_len ({prefill.max_len}) and the decode engine's "
                f"({decode.max_len}) must be equal: rows move between their caches"
            )
        self.prefill, self.decode = prefill, decode
        self.transfer = transfer or DevicePutTransfer()
        self._decode_mesh = decode_mesh
        self._threaded = threaded
        # Shared with the prefill thread, under `_lock`:
        self._lock = threading.Condition()
        self._waiting: collections.deque = collections.deque()
        self._moving: collections.deque = collections.deque()  # (request state, row)
        self._cancels: set = set()
        self._events: list[TokenEvent] = []  # first tokens, from the prefill side
        self._finished: list[Completion] = []
        self._prefilling: set = set()  # ids of the requests inside the prefill engine
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None
        self._closed = False
        self.transfers = 0  # rows moved from prefill to decode

    # What a server reads of an engine: the decode side's limits, both sides' counts.
    @property
    def num_slots(self) -> int:
        return self.decode.num_slots

    @property
    def max_len(self) -> int:
        return self.decode.max_len

    @property
    def vocab_size(self) -> int | None:
        return self.decode.vocab_size

    @property
    def allocator(self):
        return self.decode.allocator

    @property
    def preemptions(self) -> int:
        return self.prefill.preemptions + self.decode.preemptions

    @property
    def prompt_tokens(self) -> int:
        return self.prefill.prompt_tokens  # admission, and so the prefix cache, is there

    @property
    def prefix_hit_tokens(self) -> int:
        return self.prefill.prefix_hit_tokens

    @property
    def proposed_tokens(self) -> int:
        return self.decode.proposed_tokens  # speculation is the decode engine's

    @property
    def accepted_tokens(self) -> int:
        return self.decode.accepted_tokens

    @property
    def num_active(self) -> int:
        return len(self._prefilling) + len(self._moving) + self.decode.num_active

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def min_prefill_len(self) -> int:
        return self.prefill.min_prefill_len

    @property
    def prefill_chunk(self) -> int:
        return self.prefill.prefill_chunk

    def submit(self, request: Request | Sequence[int]) -> Any:
        """Queues a request; returns its id. Checked by both engines' limits."""
        request = self.decode.checked(self.prefill.checked(request))
        with self._lock:  # its arrival time counts toward its time to first token
            self._waiting.append(RequestState(request, submitted=time.perf_counter()))
            self._lock.notify_all()
        if self._threaded and self._thread is None:
            self._thread = threading.Thread(
                target=self._prefill_loop, name="axplug-prefill", daemon=True
            )
            self._thread.start()
        return request.id

    @property
    def has_work(self) -> bool:
        with self._lock:
            return bool(
                self._waiting or self._moving or self._events or self._prefilling
                or self.decode.has_work
            )  # fmt: skip

    def step(self) -> list[TokenEvent]:
        """The hand-off of prefilled rows and one decode step (and, unthreaded, one prefill
        step first). With nothing to decode it waits briefly for the prefill side."""
        if not self._threaded:
            self._prefill_step()
        self._raise_prefill_error()
        with self._lock:
            if not (self._moving or self._events or self.decode.has_work):
                self._lock.wait(0.01)  # the prefill thread notifies when it has output
            candidates = list(self._moving)
            self._moving.clear()
        attached = 0
        for item in candidates:
            if not self.decode.attach(*item):
                break
            attached += 1
        with self._lock:
            self._moving.extendleft(reversed(candidates[attached:]))
            self.transfers += attached
            events, self._events = self._events, []
            if attached:
                self._lock.notify_all()  # decode rows were taken: admission room changed
        if self.decode.has_work:
            events += self.decode.step()
        finished = self.decode.pop_finished()
        with self._lock:
            self._finished += finished
            if finished:  # decode rows freed: the prefill side may admit again
                self._lock.notify_all()
        return events

    def run(self, on_token: Callable[[TokenEvent], None] | None = None) -> list[Completion]:
        """Steps until every request is done; the completions in the order they finished."""
        return run_to_completion(self, on_token)

    def pop_finished(self) -> list[Completion]:
        with self._lock:
            done, self._finished = self._finished, []
        return done

    def cancel(self, request_id: Any) -> bool:
        """Drops a request wherever it is; False if unknown. One being prefilled is
        dropped by the prefill side at its next step."""
        with self._lock:
            for state in self._waiting:
                if state.request.id == request_id:
                    self._waiting.remove(state)
                    self._finished.append(state.completion("cancelled"))
                    return True
            for item in self._moving:
                if item[0].request.id == request_id:
                    self._moving.remove(item)
                    self._finished.append(item[0].completion("cancelled"))
                    return True
            if request_id in self._prefilling:
                self._cancels.add(request_id)
                return True
        if self.decode.cancel(request_id):
            with self._lock:
                self._finished += self.decode.pop_finished()
                self._lock.notify_all()
            return True
        return False

    def close(self) -> None:
        """Stops the prefill thread (requests still in it are dropped)."""
        with self._lock:
            self._closed = True
            self._lock.notify_all()
        if self._thread is not None:
            self._thread.join(30)

    # -- the prefill side ----------------------------------------------------------------------

    def _prefill_loop(self) -> None:
        try:
            while True:
                with self._lock:
                    while not self._closed and not self._room() and not self.prefill.has_work:
                        # Timed: room also opens when decode rows finish or are cancelled,
                        # which notify; the timeout bounds any wake-up that is missed.
                        self._lock.wait(0.1)
                    if self._closed:
                        return
                self._prefill_step()
        except BaseException as exc:  # noqa: BLE001 -- raised again by the next step()
            with self._lock:
                self._error = exc
                self._lock.notify_all()

    def _room(self) -> bool:
        """Whether a waiting request may enter the prefill engine (called under the lock)."""
        free = self.decode.num_free - len(self._moving) - len(self._prefilling)
        return bool(self._waiting) and free > 0

    def _prefill_step(self) -> None:
        with self._lock:
            admitted = []
            while self._room():
                admitted.append(self._waiting.popleft())
                self._prefilling.add(admitted[-1].request.id)
            cancels, self._cancels = self._cancels, set()
        for state in admitted:
            self.prefill.enqueue(state)
        for request_id in cancels:
            self.prefill.cancel(request_id)
        if not self.prefill.has_work:
            return
        events = self.prefill.step()
        moved = [(a, self.transfer.transfer(row, self._decode_mesh))
                 for a, row in self.prefill.detach_decoding()]  # fmt: skip
        finished = self.prefill.pop_finished()
        with self._lock:
            self._moving.extend(moved)
            self._events += events
            self._finished += finished
            self._prefilling -= {a.request.id for a, _ in moved} | {c.id for c in finished}
            self._lock.notify_all()

    def _raise_prefill_error(self) -> None:
        if self._error is not None:
            raise RuntimeError(f"the prefill engine failed: {self._error}") from self._error
