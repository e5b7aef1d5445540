"""How requests and rows enter (and leave) an Engine: checking a request before it queues, the
pages a request takes as it enters (shared prefix pages first) and as it grows, and moving
decoding rows between engines (prefill/decode disaggregation). These are Engine methods
(`Engine.checked`, `adapters_in_use`, `_admit_pages`, `_give_pages`, `_grow_pages`,
`_add_page`, `_run_page`, `detach_decoding`, `attach`), kept here so the engine module
holds the scheduling and the step."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np

from axplug.inference import paging as pages
from axplug.inference.paging import OutOfPagesError
from axplug.inference.requests import Request, RequestState
from axplug.inference.steps import read_cache_row, write_cache_row
from axplug.layers.kv_cache import has_row_state

__all__ = ["adapters_in_use", "admit_pages", "attach", "checked", "detach_decoding",
           "give_pages"]  # fmt: skip


def checked(self, request: Request | Sequence[int]) -> Request:
    """`request` with an id and integer prompt, or a ValueError saying why this engine
    cannot serve it (empty prompt, ids outside the vocabulary, too long, too few pages)."""
    if not isinstance(request, Request):
        request = Request(prompt=request)
    if request.id is None:
        request = dataclasses.replace(request, id=next(self._ids))
    prompt = [int(t) for t in request.prompt]
    name = f"request {request.id!r}"
    if not prompt:
        raise ValueError(f"{name}: the prompt is empty; give at least one token")
    if self.vocab_size is not None and not all(0 <= t < self.vocab_size for t in prompt):
        bad = next(t for t in prompt if not 0 <= t < self.vocab_size)
        raise ValueError(f"{name}: token id {bad} is outside the vocabulary [0, {self.vocab_size})")
    sampling = request.sampling
    if problem := self._rows.problem(sampling):  # fails here, never in a step
        raise ValueError(f"{name}: {problem}")
    if not (isinstance(request.adapter, int) and 0 <= request.adapter <= self.adapter_slots):
        raise ValueError(
            f"{name}: adapter {request.adapter!r} is not one of this engine's "
            f"{self.adapter_slots} adapter slots (1 to {self.adapter_slots}; 0: none)"
        )
    if request.constraint is not None and self.vocab_size is None:
        raise ValueError(f"{name}: a constraint needs the model's vocab_size")
    for field in ("logprobs", "prompt_logprobs"):
        if (wanted := getattr(sampling, field) or 0) > self.max_logprobs:
            raise ValueError(
                f"{name}: {field}={wanted} asks for more top tokens than this engine's "
                f"max_logprobs ({self.max_logprobs}); ask for fewer or raise max_logprobs"
            )
    if request.embeddings is not None:
        where, vectors = (np.asarray(a) for a in request.embeddings)
        if not (where.ndim == 1 and vectors.ndim == 2 and len(where) == len(vectors) > 0):
            raise ValueError(
                f"{name}: embeddings must be (prompt indices [n], vectors [n, dim]) with n >= 1, "
                f"got shapes {list(where.shape)} and {list(vectors.shape)}"
            )
        if where[0] < 0 or where[-1] >= len(prompt) or np.any(np.diff(where) <= 0):
            raise ValueError(
                f"{name}: embeddings' indices must rise strictly within the prompt's "
                f"{len(prompt)} tokens"
            )
    needed = len(prompt) + max(sampling.max_new_tokens, 1) - 1
    if needed > self.max_len:
        raise ValueError(
            f"{name}: {len(prompt)} prompt tokens + {request.sampling.max_new_tokens} new "
            f"tokens need {needed} cache slots but the engine's max_len is {self.max_len}; "
            "shorten the prompt, lower max_new_tokens or raise max_len"
        )
    if self.allocator is not None and self._pages_for(needed) > self.allocator.num_pages:
        raise OutOfPagesError(
            f"{name}: needs {self._pages_for(needed)} pages of {self.page_size} tokens, the "
            f"pool has {self.allocator.num_pages}; raise the paged cache's num_pages"
        )
    return dataclasses.replace(request, prompt=prompt)


def adapters_in_use(self) -> set[int]:
    """The adapter slots of the requests waiting or running."""
    live = [*self._waiting, *filter(None, self._slots)]
    return {a.request.adapter for a in live} - {0}


def grow_pages(self, feeds: dict[int, list[int]]) -> None:
    """Pages for what each row writes this step, oldest rows first; the newest rows are
    preempted (and dropped from `feeds`) while the pool has none."""
    for slot in sorted(feeds, key=lambda s: self._slots[s].admitted):
        active = self._slots[slot]
        if active is None:  # preempted below for an older row
            continue
        needed = self._pages_for(active.cached + len(feeds[slot]))
        while len(active.pages) < needed and self._slots[slot] is active:
            if self.allocator.num_free:
                self._add_page(slot)
            else:
                newest = max(feeds, key=lambda s: self._slots[s].admitted)
                self._preempt(newest)
                del feeds[newest]


def run_page(self, slot: int, i: int) -> int:
    """The `i`th page of the run the allocator gives `slot`'s row where free."""
    return slot * self._table.shape[1] + i


def add_page(self, slot: int) -> None:
    """One more page for the request in `slot`, from its own run where free."""
    active = self._slots[slot]
    page = self.allocator.allocate(1, self._run_page(slot, len(active.pages)))[0]
    self._table[slot, len(active.pages)] = page
    active.pages.append(page)


def detach_decoding(self) -> list[tuple[RequestState, Any]]:
    """Every request that is decoding, taken out with its cached row (`read_row` form):
    its row and pages are free at once, and it is not finished."""
    if has_row_state(self._cache):
        raise ValueError(
            "this model keeps per-row position state (a multimodal rotary offset) that a "
            "row moved to another engine would lose; serve it without --prefill-devices"
        )
    out = []
    for slot, active in enumerate(self._slots):
        if active is None or not active.decoding:
            continue
        row = read_cache_row(self._cache, slot)  # the cache's block table still names its pages
        out.append((self._vacate(slot), row))
    return out


def attach(self, active: RequestState, row: Any) -> bool:
    """Takes a request detached from another engine of the same model and `max_len`, with
    its row (already on this engine's devices); False when no row or pages are free."""
    if None not in self._slots:
        return False
    slot = self._slots.index(None)
    if not self._give_pages(slot, active, active.cached):
        return False
    self._cache = write_cache_row(self._cache, slot, row, self._table)
    self._occupy(slot, active)
    # The row is written; its length restarts at what is cached (a step the other engine ran
    # ahead may have written one more token).
    active.start = active.cached
    self._rows.restore_counts(slot, active)  # the other engine kept its penalty counts
    return True


def admit_pages(self, slot: int, active: RequestState) -> bool:
    """Pages for a request taking `slot`: its prefix's cached pages, shared, and new ones
    for its first feed; False (holding none) when too few are free or a row is computing
    its prefix's next page (it shares that page next step)."""
    if self.allocator is None:
        return True
    if pages.prefix_in_flight(self.allocator, active, self._slots):
        return False
    shared = self.allocator.share(pages.shareable(self.allocator, active))
    active.cached = len(shared) * self.page_size
    if not self._give_pages(slot, active, active.cached + len(active.feed(self.prefill_chunk)),
                            shared):  # fmt: skip
        self.allocator.release(shared)
        active.cached = 0
        return False
    self.prompt_tokens += active.context_len
    self.prefix_hit_tokens += active.cached
    return True


def give_pages(self, slot: int, active: RequestState, tokens: int, shared=()) -> bool:
    """Pages for `tokens` to a request taking `slot` (a paged cache), after the `shared`
    ones it holds already; False if too few are free."""
    if self.allocator is None:
        return True
    count = self._pages_for(tokens) - len(shared)
    if count > self.allocator.num_free:
        return False
    active.pages = [*shared, *self.allocator.allocate(count, self._run_page(slot, len(shared)))]
    active.registered = len(shared)
    self._table[slot] = self.allocator.num_pages  # no page (the cache's sentinel)
    self._table[slot, : len(active.pages)] = active.pages
    return True
