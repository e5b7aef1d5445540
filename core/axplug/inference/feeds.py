"""What one engine step feeds its compiled call: each fed row's tokens and positions (one
width for all rows, bucketed), and which log-probabilities the step returns."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np

from axplug.api import EMPTY_POSITION

__all__ = ["StepFeed", "inserted_inputs", "step_feed"]


class StepFeed(NamedTuple):
    ids: np.ndarray  # [rows, width]
    positions: np.ndarray  # [rows, width], EMPTY_POSITION past a row's fed tokens
    last: np.ndarray  # [rows]: each row's last fed token
    start: np.ndarray  # [rows]: the cache length a row starts from (-1: as it is)
    counts: np.ndarray  # [rows]: tokens each row has generated (its sampling key's step)
    targets: np.ndarray  # [rows, width]: each fed position's next prompt token
    logprobs: int | None  # static top-token counts: None, 0, or max_logprobs
    prompt_logprobs: int | None


def _bucket(length: int, minimum: int, maximum: int) -> int:
    return min(maximum, max(minimum, 1 << max(0, length - 1).bit_length()))


def step_feed(
    slots: Sequence[Any], feeds: dict[int, list[int]], *, min_prefill_len: int, max_len: int,
    max_logprobs: int, decode_width: int = 1,
) -> StepFeed:  # fmt: skip
    """The arrays of a step that feeds `feeds[slot]` to the requests in `slots`:
    `decode_width` (1, or a decoding token and its drafts) when no feed is longer, else the
    longest feed's power-of-two bucket in [min_prefill_len, max_len] (a program per width)."""
    longest = max(map(len, feeds.values()))
    width = decode_width if longest <= decode_width else _bucket(longest, min_prefill_len, max_len)
    n = len(slots)
    ids = np.zeros((n, width), np.int32)
    positions = np.full((n, width), EMPTY_POSITION, np.int32)
    last = np.zeros((n,), np.int32)
    start = np.full((n,), -1, np.int32)
    counts = np.zeros((n,), np.int32)
    targets = np.zeros((n, width), np.int32)
    # Static top-token counts: 0, or max_logprobs once any row asks for some (two programs
    # at most, not one per count asked).
    logprobs = prompt_logprobs = None
    for s, feed in feeds.items():
        active = slots[s]
        k = len(feed)
        ids[s, :k] = feed
        positions[s, :k] = range(active.cached, active.cached + k)
        last[s] = k - 1
        # A new (or recomputed) row starts empty or after a cached prefix; a row that
        # rejected drafts, before them.
        start[s] = -1 if active.start is None else active.start
        counts[s] = len(active.output)
        sampling = active.request.sampling
        if sampling.logprobs is not None:
            logprobs = max(logprobs or 0, max_logprobs if sampling.logprobs else 0)
        if sampling.prompt_logprobs is not None and active.cached + 1 < len(active.request.prompt):
            asked = max_logprobs if sampling.prompt_logprobs else 0
            prompt_logprobs = max(prompt_logprobs or 0, asked)
            following = active.context[active.cached + 1 : active.cached + k + 1]
            targets[s, : len(following)] = following
    return StepFeed(ids, positions, last, start, counts, targets, logprobs, prompt_logprobs)


def inserted_inputs(slots: Sequence[Any], positions: np.ndarray) -> tuple | None:
    """(mask [rows, width], embeddings [rows, width, dim]) of the fed positions whose prompt
    token a row's request replaces (`Request.embeddings`); None when no row does."""
    rows = [(s, a.request.embeddings) for s, a in enumerate(slots)
            if a is not None and a.request.embeddings is not None]  # fmt: skip
    if not rows:
        return None
    dim = np.shape(rows[0][1][1])[-1]
    mask = np.zeros(positions.shape, bool)
    values = np.zeros((*positions.shape, dim), np.float32)
    for s, (where, vectors) in rows:
        where = np.asarray(where)
        found = np.minimum(np.searchsorted(where, positions[s]), len(where) - 1)
        mask[s] = where[found] == positions[s]
        values[s, mask[s]] = np.asarray(vectors, np.float32)[found[mask[s]]]
    return (mask, values) if mask.any() else None  # decoding: the plain program
