"""Prefill/decode disaggregation: prompts prefilled by one Engine, decoded by another.

The two engines usually sit on different device sets (meshes), so a long prefill never
delays the decode steps of other requests and each side is sized for its own work. A request
is prefilled (and gets its first token) in the prefill engine; its cached row is then read
out in a layout-free form (`axplug.layers.kv_cache.read_row`), moved by a `KVTransfer` and
written into a free row (and pages) of the decode engine, where it decodes to the end.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import jax

from axplug.inference.engine import Completion, Engine, Request, TokenEvent

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
    enters the prefill engine only when a decode row is sure to be free for it, so
    prefilled rows never pile up.
    """

    def __init__(
        self,
        prefill: Engine,
        decode: Engine,
        *,
        transfer: KVTransfer | None = None,
        decode_mesh: jax.sharding.Mesh | None = None,
    ):
        if prefill.max_len != decode.max_len:
            raise ValueError(
                f"the prefill engine's max_len ({prefill.max_len}) and the decode engine's "
                f"({decode.max_len}) must be equal: rows move between their caches"
            )
        self.prefill, self.decode = prefill, decode
        self.transfer = transfer or DevicePutTransfer()
        self._decode_mesh = decode_mesh
        self._waiting: collections.deque = collections.deque()
        self._moving: collections.deque = collections.deque()  # (request state, row)
        self._finished: list[Completion] = []
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
    def num_active(self) -> int:
        return self.prefill.num_active + len(self._moving) + self.decode.num_active

    @property
    def num_waiting(self) -> int:
        return len(self._waiting) + self.prefill.num_waiting

    @property
    def min_prefill_len(self) -> int:
        return self.prefill.min_prefill_len

    @property
    def prefill_chunk(self) -> int:
        return self.prefill.prefill_chunk

    def submit(self, request: Request | Sequence[int]) -> Any:
        """Queues a request; returns its id. Checked by both engines' limits."""
        request = self.decode.checked(self.prefill.checked(request))
        self._waiting.append(request)
        return request.id

    @property
    def has_work(self) -> bool:
        return bool(self._waiting or self._moving or self.prefill.has_work or self.decode.has_work)

    def step(self) -> list[TokenEvent]:
        """One prefill step, the hand-off of the rows it finished, one decode step."""
        # Admit only what the decode side can take: its free rows less what is on its way.
        room = (
            self.decode.num_free
            - len(self._moving)
            - self.prefill.num_active
            - self.prefill.num_waiting
        )
        while self._waiting and room > 0:
            self.prefill.submit(self._waiting.popleft())
            room -= 1
        events = self.prefill.step()
        for active, row in self.prefill.detach_decoding():
            self._moving.append((active, self.transfer.transfer(row, self._decode_mesh)))
        while self._moving and self.decode.attach(*self._moving[0]):
            self._moving.popleft()
            self.transfers += 1
        events += self.decode.step()
        self._finished += self.prefill.pop_finished() + self.decode.pop_finished()
        return events

    def run(self, on_token: Callable[[TokenEvent], None] | None = None) -> list[Completion]:
        """Steps until every request is done; the completions in the order they finished."""
        while self.has_work:
            for event in self.step():
                if on_token is not None:
                    on_token(event)
        return self.pop_finished()

    def pop_finished(self) -> list[Completion]:
        done, self._finished = self._finished, []
        return done

    def cancel(self, request_id: Any) -> bool:
        """Drops a request wherever it is; False if unknown."""
        for request in self._waiting:
            if request.id == request_id:
                self._waiting.remove(request)
                self._finished.append(Completion(request_id, list(request.prompt), [],
                                                 "cancelled", 0.0))  # fmt: skip
                return True
        for item in self._moving:
            if item[0].request.id == request_id:
                self._moving.remove(item)
                active = item[0]
                self._finished.append(Completion(request_id, list(active.request.prompt),
                                                 active.output, "cancelled",
                                                 active.first_token_s))  # fmt: skip
                return True
        found = self.prefill.cancel(request_id) or self.decode.cancel(request_id)
        self._finished += self.prefill.pop_finished() + self.decode.pop_finished()
        return found
