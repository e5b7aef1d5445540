"""Continuous batching: a fixed set of KV-cache rows (slots) serving a stream of requests.

Every `step()` is one model call over all rows. A row that is decoding feeds its last token;
a row whose prompt is not cached yet feeds its next prompt tokens (all of them, or at most
`prefill_chunk`), so prompts arriving never pause the rows that are decoding, and a long
prompt is spread over several steps (chunked prefill). The call's width is 1 when every row
decodes, else the longest feed rounded up to a power of two. Rows that take no part get
padding tokens, which the caches never write (see `axplug.layers.kv_cache`), so every
request decodes exactly as it would alone. Finished requests leave their row at once. With a
paged cache the engine owns the page pool: a row holds pages for what it has cached and
takes more as it grows; with prefix caching (the default) a request starts from the cached
full pages of its prompt's longest cached prefix, shared read-only with the rows that
computed them, and waits a step while a row is computing them.
"""

from __future__ import annotations

import collections
import itertools
import math
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from axplug.component_spec import component_config
from axplug.inference import admission, ahead
from axplug.inference import paging as pages
from axplug.inference.feeds import inserted_inputs, step_feed
from axplug.inference.paging import PageAllocator, model_paging
from axplug.inference.requests import (
    Completion,
    Logprob,
    Request,
    RequestState,
    TokenEvent,
)
from axplug.inference.rows import RowSettings
from axplug.inference.speculation import Proposer, propose
from axplug.inference.steps import bind_extend_rows, one_device_placement
from axplug.layers.kv_cache import assigning_pages, has_row_state
from axplug.mesh import DEFAULT_AXIS_RULES
from axplug.sharding import make_scope, sharding_scope

__all__ = ["Engine"]


class Engine:
    """Serves requests with `model` (a CausalLM) and `params` over `num_slots` cache rows.

    With a `mesh`, every call traces inside its sharding scope (`axis_rules`), as training does.
    A request may ask for up to `max_logprobs` top tokens with its log-probabilities; a step
    computes them only when a row asks (see `SamplingParams.logprobs`). `prefix_caching`
    (paged caches) shares full prompt pages between requests (see `PageAllocator`); requests
    that score their prompt or use penalties compute theirs. `speculative` (a `Proposer` or
    its spec, `NAME:key=value,...`) proposes tokens that each decode step verifies at once
    (rows with penalties decode plainly); `accepted_tokens / proposed_tokens` is its rate.
    `adapter_slots`: how many adapters the model's layers hold, one per row chosen by
    `Request.adapter` (1 to `adapter_slots`; 0: none), read as `side_input("adapter")`.
    """

    def __init__(
        self,
        model: Any,
        params: Any,
        *,
        num_slots: int = 8,
        max_len: int = 256,
        min_prefill_len: int = 16,
        prefill_chunk: int | None = None,
        max_logprobs: int = 20,
        mesh: jax.sharding.Mesh | None = None,
        axis_rules: Sequence[tuple[str, Any]] = DEFAULT_AXIS_RULES,
        prefix_caching: bool = True,
        speculative: str | Proposer | None = None,
        adapter_slots: int = 0,
    ):
        for method in ("init_cache_state", "extend_step"):
            if not hasattr(model, method):
                raise TypeError(
                    f"{getattr(model, 'path', model)}: {type(model).__qualname__} has no "
                    f"{method}(); decoding needs a CausalLM (or a layer with the same methods)"
                )
        if num_slots < 1 or max_len < 1:
            raise ValueError(f"num_slots ({num_slots}) and max_len ({max_len}) must be >= 1")
        if prefill_chunk is not None and prefill_chunk < 1:
            raise ValueError(f"prefill_chunk={prefill_chunk} must be >= 1 (None: whole prompts)")
        if max_logprobs < 0:
            raise ValueError(f"max_logprobs={max_logprobs} must be >= 0")
        self.adapter_slots = adapter_slots
        self.prefill_chunk = prefill_chunk or max_len
        self.max_logprobs = max_logprobs
        self.model, self.params = model, params
        self._scope = make_scope(mesh, axis_rules)
        self._extend_rows = bind_extend_rows(self.model, self._scope)
        self.num_slots, self.max_len, self.min_prefill_len = num_slots, max_len, min_prefill_len
        self.vocab_size = getattr(getattr(model.config, "decoder", None), "vocab_size", None)
        init = model.init_cache_state
        if self._scope is not None and self._scope.mesh.size > 1:
            # Made on the mesh as the steps lay it out: not whole on one device, and the first
            # step's program is the next one's.
            init = jax.jit(init, static_argnums=(0, 1))
        with assigning_pages(), sharding_scope(self._scope):  # the allocator gives rows pages
            # Ready before the first request, whose time to first token must not include it.
            self._cache = jax.block_until_ready(init(num_slots, max_len))
        self._placed = one_device_placement(params)
        if self._placed is not None:  # where the steps will return it
            self._cache = jax.device_put(self._cache, self._placed)
        paging = model_paging(model, num_slots, max_len)
        self.page_size = paging.page_size if paging else None
        self.allocator = PageAllocator(*paging[:2], caching=prefix_caching) if paging else None
        # Context tokens of admitted requests, and those read from the prefix cache.
        self.prompt_tokens = self.prefix_hit_tokens = 0
        # Every entry starts as "no page" (the pool size, the paged cache's sentinel).
        no_page = paging.num_pages if paging else 0
        self._table = np.full((num_slots, paging.pages_per_row if paging else 1), no_page, np.int32)
        self._slots: list[RequestState | None] = [None] * num_slots
        self._waiting: collections.deque[RequestState] = collections.deque()
        self._ids = itertools.count()
        self._finished: list[Completion] = []
        self._rows = RowSettings(num_slots, self.vocab_size)
        self._admissions = itertools.count()
        self.preemptions = 0  # requests sent back to the queue for want of pages
        self._ahead: ahead.Pending | None = None  # dispatched, its tokens not read yet
        if isinstance(speculative, str):
            spec = component_config("proposers", speculative, "speculative")
            speculative = spec.located("speculative").instantiate()
        self.proposer, self.proposed_tokens, self.accepted_tokens = speculative, 0, 0
        if speculative is not None:
            if has_row_state(self._cache):
                raise ValueError(
                    f"speculative={type(speculative).__name__}: rejected drafts rewind rows, "
                    "which would lose this model's per-row position state (a multimodal "
                    "rotary offset); decode it without speculation"
                )
            self._num_drafts = speculative.config.num_tokens
            speculative.bind(self)

    # -- requests ------------------------------------------------------------------------------

    def submit(self, request: Request | Sequence[int]) -> Any:
        """Queues a request (or a bare prompt, sampled with the defaults); returns its id."""
        request = self.checked(request)
        self.enqueue(RequestState(request, submitted=time.perf_counter()))
        return request.id

    checked, adapters_in_use = admission.checked, admission.adapters_in_use

    def enqueue(self, state: RequestState) -> None:
        """Queues a `checked` request's state (its arrival time kept: another engine's)."""
        self._waiting.append(state)

    @property
    def has_work(self) -> bool:
        """Whether requests are waiting or decoding."""
        return bool(self._waiting) or any(s is not None for s in self._slots)

    @property
    def num_active(self) -> int:
        """Requests holding a cache row."""
        return sum(s is not None for s in self._slots)

    @property
    def num_free(self) -> int:
        """Rows no request holds."""
        return self._slots.count(None)

    @property
    def num_waiting(self) -> int:
        """Requests queued for a cache row (new or preempted)."""
        return len(self._waiting)

    def cancel(self, request_id: Any) -> bool:
        """Drops a waiting or running request, freeing its row and pages; False if unknown.

        A running one finishes with `finish_reason="cancelled"` and what it had generated.
        """
        for active in self._waiting:
            if active.request.id == request_id:
                self._waiting.remove(active)
                self._finish(active, "cancelled")
                return True
        for slot, active in enumerate(self._slots):
            if active is not None and active.request.id == request_id:
                self._retire(slot, "cancelled")
                return True
        return False

    def step(self) -> list[TokenEvent]:
        """Admits waiting requests into free rows, then runs one call over every active row:
        decoding rows get their next token, prefilling rows cache their next prompt chunk
        (and get their first token once the prompt is cached).

        With a paged cache a request holds pages for what it has cached, one more as each
        page fills; when the pool runs dry the newest request gives its pages back and waits
        at the head of the queue (re-prefilled from its prompt and output when pages free up:
        recompute, so its tokens are unchanged), so the oldest requests always progress.
        """
        if (pending := self._ahead) is not None:  # the step after it goes first, if it can
            self._ahead = ahead.dispatch_after(self, pending)
            return self._collect(pending)
        self._admit()
        feeds = {s: a.feed(self.prefill_chunk) for s, a in enumerate(self._slots) if a is not None}
        drafts = {}
        if self.proposer is not None:
            drafts = propose(self.proposer, self._slots, self._num_drafts, self.max_len)
        for s, drafted in drafts.items():
            feeds[s] = [*feeds[s], *drafted]
        if self.allocator is not None:
            self._grow_pages(feeds)
        if not feeds:
            return []
        pending = self._dispatch(feeds, {s: d for s, d in drafts.items() if s in feeds})
        self._ahead = ahead.dispatch_after(self, pending)
        return self._collect(pending)

    # Moving decoding rows between engines (prefill/decode disaggregation).
    detach_decoding, attach = admission.detach_decoding, admission.attach
    _admit_pages, _give_pages = admission.admit_pages, admission.give_pages
    _grow_pages, _add_page, _run_page = admission.grow_pages, admission.add_page, admission.run_page

    def run(self, on_token: Callable[[TokenEvent], None] | None = None) -> list[Completion]:
        """Steps until every request is done; the completions in the order they finished."""
        from axplug.inference.generation import run_to_completion

        return run_to_completion(self, on_token)

    def pop_finished(self) -> list[Completion]:
        """Completions finished since the last call."""
        done, self._finished = self._finished, []
        return done

    # -- scheduling ----------------------------------------------------------------------------

    def _pages_for(self, tokens: int) -> int:
        return math.ceil(tokens / self.page_size)

    def _admit(self) -> None:
        for slot in range(self.num_slots):
            if not self._waiting:
                break
            if self._slots[slot] is not None:
                continue
            active = self._waiting[0]
            # First come, first served: wait for pages to be released, or for a row to
            # finish computing pages of this request's prefix (then share them).
            if not self._admit_pages(slot, active):
                break
            self._waiting.popleft()
            self._occupy(slot, active)
            active.start = active.cached

    def _preempt(self, slot: int) -> None:
        active = self._vacate(slot)
        active.cached = 0
        self._waiting.appendleft(active)  # first in line again
        self.preemptions += 1

    def _dispatch(self, feeds, drafts, after: ahead.Pending | None = None) -> ahead.Pending:
        """Starts the step that feeds `feeds` (and `drafts`); `after`: a dispatched step whose
        tokens the rows feed, before the host has read them (`ahead.dispatch_after`)."""
        k = self._num_drafts if drafts else 0
        fed = step_feed(self._slots, feeds, min_prefill_len=self.min_prefill_len,
                        max_len=self.max_len, max_logprobs=self.max_logprobs,
                        decode_width=k + 1)  # fmt: skip
        if after is not None:  # each row one position and one sample on, not restarted
            for s in feeds:
                fed.positions[s, 0] += len(after.feeds[s])
                fed.counts[s] += 1
            fed.start[:] = -1
        proposed, n = None, len(self._slots)
        if drafts:  # [rows, K] drafts and how many each row has
            proposed = np.zeros((n, k), np.int32), np.zeros(n, np.int32)
            for s, drafted in drafts.items():
                proposed[0][s, : len(drafted)], proposed[1][s] = drafted, len(drafted)
        # Host arrays go to the jitted call as they are: its C++ path moves them to the
        # devices faster than a jnp.asarray each. The table is copied: rows may change it
        # while the step runs.
        rows, ids = self._rows, fed.ids if after is None else after.tokens[:, None]
        if after is None and self._placed is not None:
            ids = jax.device_put(ids, self._placed)
        penalties = rows.penalty_inputs(self._slots, fed.positions)
        allowed = rows.allowed_inputs(self._slots, feeds)
        inserted = None if after is not None else inserted_inputs(self._slots, fed.positions)
        tokens, accepted, scores, self._cache, kept = self._extend_rows(
            # One program per prefill width and one for decoding (per log-probability width).
            fed.logprobs, fed.prompt_logprobs, self.params, self._cache, ids, fed.positions,
            fed.start, self._table.copy(), fed.last, fed.targets, rows.keys, fed.counts,
            penalties, allowed, rows.adapter_inputs(), inserted, proposed, *rows.sampling,
        )  # fmt: skip
        rows.keep(kept)
        plain = all(x is None for x in (penalties, allowed, proposed, fed.prompt_logprobs))
        return ahead.Pending(tokens, accepted, scores, feeds, drafts, tuple(self._slots), plain)

    def _collect(self, pending: ahead.Pending) -> list[TokenEvent]:
        """Reads a dispatched step's tokens and records them (rows that left since: skipped)."""
        feeds, drafts, proposed = pending.feeds, pending.drafts, pending.drafts or None
        n = len(self._slots)
        tokens = np.asarray(pending.tokens).reshape(n, -1)
        accepted = np.zeros(n, int) if pending.accepted is None else np.asarray(pending.accepted)
        scores = jax.device_get(pending.scores) if pending.scores else {}  # a fetch: ~70 us
        now = time.perf_counter()
        events = []
        for s, feed in feeds.items():
            active = self._slots[s]
            if active is None or active is not pending.rows[s]:
                continue
            if "prompt" in scores and active.request.sampling.prompt_logprobs is not None:
                active.note_prompt_logprobs(len(feed), [a[s] for a in scores["prompt"]])
            self.proposed_tokens += len(drafted := drafts.get(s, []))
            self.accepted_tokens += (taken := int(accepted[s]))
            # The rejected drafts' cache entries: the next step starts the row before them.
            active.cached += len(feed) - len(drafted) + taken
            active.start = active.cached if taken < len(drafted) else None
            if self.allocator is not None:
                pages.register_pages(self.allocator, active, drafted[:taken])
            if active.cached - taken == active.context_len:  # all cached: next tokens
                top_n = active.request.sampling.logprobs
                for j, token in enumerate(tokens[s, : taken + 1].tolist()):
                    logprob = None
                    if top_n is not None:
                        at = [a[s] if proposed is None else a[s][j] for a in scores["token"]]
                        logprob = Logprob.of(token, *at, top_n)
                    events.append(event := self._record(s, token, now, logprob))
                    if event.finish_reason is not None:
                        break
        return events

    def _occupy(self, slot: int, active: RequestState) -> None:
        """Puts `active` in `slot`: its admission order, key and sampling settings."""
        active.admitted = next(self._admissions)
        self._slots[slot] = active
        self._rows.set(slot, active.request.sampling, active.request.adapter)

    def _vacate(self, slot: int) -> RequestState:
        """Frees `slot` (and its pages); an empty row samples greedily, so an all-greedy
        batch skips the sampler's sort and noise."""
        active, self._slots[slot] = self._slots[slot], None
        self._rows.clear(slot)
        if not any(self._slots):  # a step run ahead has no row left to deliver to
            self._ahead = None
        if self.allocator is not None:
            self.allocator.release(active.pages)
            active.pages, active.registered = [], 0
            self._table[slot] = self.allocator.num_pages
        return active

    def _record(
        self, slot: int, token: int, now: float, logprob: Logprob | None = None
    ) -> TokenEvent:
        active = self._slots[slot]
        sampling = active.request.sampling
        if not active.output:
            active.first_token_s = now - active.submitted
        if sampling.max_new_tokens == 0:  # the prompt was only to be scored
            self._retire(slot, "length")
            return TokenEvent(active.request.id, None, "length")
        if token in sampling.stop_tokens:
            self._retire(slot, "stop")
            return TokenEvent(active.request.id, None, "stop")
        active.output.append(token)
        if logprob is not None:
            active.output_logprobs.append(logprob)
        if active.request.constraint is not None and active.request.constraint.accept(token):
            self._retire(slot, "stop")  # nothing may follow
            return TokenEvent(active.request.id, token, "stop", logprob)
        if len(active.output) >= sampling.max_new_tokens:
            self._retire(slot, "length")
            return TokenEvent(active.request.id, token, "length", logprob)
        return TokenEvent(active.request.id, token, logprob=logprob)

    def _retire(self, slot: int, reason: str) -> None:
        self._finish(self._vacate(slot), reason)

    def _finish(self, active: RequestState, reason: str) -> None:
        self._finished.append(active.completion(reason))
