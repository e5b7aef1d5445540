"""Running a decode step ahead: the step after a dispatched one starts before the host reads
that one's tokens, each row's next input taken from them on the device, so the host's work
(recording one step, building the next) overlaps the device's instead of following it."""

from __future__ import annotations

from typing import Any, NamedTuple

__all__ = ["Pending", "dispatch_after"]


class Pending(NamedTuple):
    """A dispatched step: its outputs (device arrays), what it fed, and the rows then."""

    tokens: Any
    accepted: Any
    scores: dict
    feeds: dict[int, list[int]]
    drafts: dict[int, list[int]]
    rows: tuple  # each slot's request state at dispatch (None: empty)
    plain: bool  # no drafts, penalties, constraints or prompt scores


def dispatch_after(engine, pending: Pending) -> Pending | None:
    """The step after `pending`, dispatched before its tokens are read: every row `pending`
    fed samples a token there and decodes on from it (a row that reaches `max_new_tokens`
    there sits it out; one that stops on a token computes a step that is dropped). None when
    the next step needs the host first: drafts, penalties, a constraint, prompt scores, a
    prefill still going, a request waiting or joining, or no free page where a row needs one."""
    if not pending.plain or engine.proposer is not None or engine.num_waiting:
        return None
    feeds = {}
    for s, active in enumerate(engine._slots):
        if active is None:
            continue
        if active is not pending.rows[s] or s not in pending.feeds:
            return None  # joined since (attached)
        if active.cached + len(pending.feeds[s]) != active.context_len:
            return None  # prefilling on
        if len(active.output) + 1 < active.request.sampling.max_new_tokens:
            feeds[s] = [0]  # the id comes from `pending`'s tokens
    if engine.allocator is not None:
        grow = [s for s in feeds if engine._pages_for(engine._slots[s].context_len + 1)
                > len(engine._slots[s].pages)]  # fmt: skip
        if len(grow) > engine.allocator.num_free:
            return None
        for s in grow:
            engine._add_page(s)
    return engine._dispatch(feeds, {}, after=pending) if feeds else None
