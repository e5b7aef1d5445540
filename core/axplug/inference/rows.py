"""Each cache row's sampling settings as the engine's compiled step takes them: keys,
temperature / top-k / top-p / min-p, and (made when a request first uses them) penalties,
logit biases and the token counts they need."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from axplug.api import EMPTY_POSITION
from axplug.inference.constraints import mask_words
from axplug.inference.requests import RequestState, seed_key
from axplug.inference.sampling import SamplingParams

__all__ = ["RowSettings"]


class RowSettings:
    """Settings of `num_slots` rows over a `vocab_size` vocabulary; empty rows are greedy."""

    def __init__(self, num_slots: int, vocab_size: int | None):
        self.num_slots, self.vocab_size = num_slots, vocab_size
        self.keys = np.zeros((num_slots, 2), np.uint32)
        # Temperature, top-k, top-p, min-p.
        self.sampling = (
            np.zeros((num_slots,), np.float32),
            np.zeros((num_slots,), np.int32),
            np.ones((num_slots,), np.float32),
            np.zeros((num_slots,), np.float32),
        )
        self.adapters = np.zeros((num_slots,), np.int32)  # each row's `Request.adapter`
        # Penalties: each row's settings on the host, token counts and seen flags on the
        # devices (the steps keep them); None until a request uses penalties or a bias.
        self._penalty_rows: dict[str, np.ndarray] | None = None
        self._counts: dict | None = None

    def problem(self, sampling: SamplingParams) -> str | None:
        """Why rows cannot take `sampling` (a seed no key holds, a bias outside the
        vocabulary), else None."""
        try:
            seed_key(sampling.seed)
        except (OverflowError, ValueError, TypeError) as exc:
            return f"seed {sampling.seed}: {exc}"
        if sampling.penalizes and self.vocab_size is None:
            return "penalties and logit_bias need the model's vocab_size"
        if bad := [t for t, _ in sampling.logit_bias if t >= (self.vocab_size or 0)]:
            return f"logit_bias token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})"
        return None

    def set(self, slot: int, sampling: SamplingParams, adapter: int = 0) -> None:
        """Row `slot` samples as `sampling` says, with adapter slot `adapter`."""
        self.adapters[slot] = adapter
        self.keys[slot] = seed_key(sampling.seed)
        temperature, top_k, top_p, min_p = self.sampling
        # A top-k past the vocabulary cuts nothing (and a huge one must not overflow int32).
        k = min(sampling.top_k, self.vocab_size or np.iinfo(np.int32).max)
        temperature[slot], top_k[slot], top_p[slot] = sampling.temperature, k, sampling.top_p
        min_p[slot] = sampling.min_p
        if sampling.penalizes or self._penalty_rows is not None:
            self._set_penalties(slot, sampling if sampling.penalizes else None)

    def clear(self, slot: int) -> None:
        """Row `slot` is empty: greedy, so an all-greedy batch skips the sampler's sort and
        noise (its penalty settings are replaced by the next request's)."""
        temperature, top_k, top_p, min_p = self.sampling
        temperature[slot], top_k[slot], top_p[slot], min_p[slot] = 0.0, 0, 1.0, 0.0
        self.adapters[slot] = 0

    def adapter_inputs(self) -> np.ndarray | None:
        """The step's `adapters` argument: None while every row runs the model as it is."""
        return self.adapters.copy() if self.adapters.any() else None

    def penalty_inputs(self, rows: list[RequestState | None], positions: np.ndarray):
        """The step's `penalties` argument: None when no row in `rows` (by slot) uses them,
        else the state with which fed tokens are generated ones (counted) and real (seen)."""
        if not any(r is not None and r.request.sampling.penalizes for r in rows):
            return None
        fed = (positions != EMPTY_POSITION).astype(np.int32)
        generated = np.zeros_like(fed)
        for slot, active in enumerate(rows):
            if active is not None:  # positions at or past the prompt's end hold outputs
                generated[slot] = fed[slot] * (positions[slot] >= len(active.request.prompt))
        return {**self._counts, **self._penalty_rows, "output_mask": generated, "fed_mask": fed}

    def allowed_inputs(self, rows: list[RequestState | None], feeds) -> np.ndarray | None:
        """The step's `allowed` argument: None when no row in `feeds` has a constraint, else
        each row's allowed tokens as mask words (every token for a row without one)."""
        constrained = [s for s in feeds if rows[s].request.constraint is not None]
        if not constrained:
            return None
        words = np.full((self.num_slots, mask_words(self.vocab_size)), -1, np.int32)
        for s in constrained:
            rows[s].request.constraint.fill(words[s])
        return words

    def keep(self, counts: dict | None) -> None:
        """The token counts a step returned (None: it used no penalties)."""
        if counts is not None:
            self._counts = counts

    def restore_counts(self, slot: int, active: RequestState) -> None:
        """Row `slot`'s counts for what `active` fed elsewhere (another engine): all but its
        last token, which the next step feeds and counts."""
        if not active.request.sampling.penalizes:
            return
        fed = active.output[:-1]
        counts = np.bincount(np.asarray(fed, np.int64), minlength=self.vocab_size)
        seen = np.zeros((self.vocab_size,), np.int32)
        seen[[*active.request.prompt, *fed]] = 1
        self._counts = {
            "counts": jnp.asarray(self._counts["counts"]).at[slot].set(counts.astype(np.int32)),
            "seen": jnp.asarray(self._counts["seen"]).at[slot].set(seen),
        }

    def _set_penalties(self, slot: int, sampling: SamplingParams | None) -> None:
        """Row `slot`'s penalty settings (neutral for None); the state is made on first use."""
        n, vocab = self.num_slots, self.vocab_size
        if self._penalty_rows is None:
            self._penalty_rows = {
                "presence": np.zeros((n,), np.float32),
                "frequency": np.zeros((n,), np.float32),
                "repetition": np.ones((n,), np.float32),
                "bias": np.zeros((n, vocab), np.float32),
            }
            zeros = np.zeros((n, vocab), np.int32)
            self._counts = {"counts": zeros, "seen": zeros}
        rows = self._penalty_rows
        neutral = sampling is None
        rows["presence"][slot] = 0.0 if neutral else sampling.presence_penalty
        rows["frequency"][slot] = 0.0 if neutral else sampling.frequency_penalty
        rows["repetition"][slot] = 1.0 if neutral else sampling.repetition_penalty
        rows["bias"][slot] = 0.0
        for token, bias in () if neutral else sampling.logit_bias:
            rows["bias"][slot, token] = bias
