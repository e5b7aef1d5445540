"""What attention kernels are given: the mask of a dense call and the pages of a paged one."""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp

__all__ = ["EMPTY_POSITION", "AttentionMask", "PagedKV", "linear_bias"]

# Position of a slot that holds no token: after every real position.
EMPTY_POSITION = 2**30


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class AttentionMask:
    """Which keys each query may see, and how the scores are biased: positions, segments and
    bias slopes are data, the kind is static. Part of the plugin API (docs/plugin-reference.md).

    A key is allowed when `kv_position <= q_position` (causal; up to the query's
    `q_causal_limits` entry instead where given: an image's tokens see the whole image),
    `q - kv < sliding_window` (`|q - kv|` when not causal) and the segment ids are equal.
    `logit_softcap` (static) soft-caps the scaled scores, `s = cap * tanh(s / cap)` (Gemma 2),
    before any bias and the mask. `linear_bias_slopes` [heads] adds `-slope[h] *
    |q_position - kv_position|` to head h's scaled scores (ALiBi). Dispatch gives a cap only
    to kernels that declare `supports_logit_softcap`, slopes only to those that declare
    `supports_linear_bias` and limits only to those that declare `supports_causal_limits`.
    Padding and empty cache slots have position `EMPTY_POSITION`, which a causal mask hides.
    """

    q_positions: jax.Array  # [batch, q_len] int32
    kv_positions: jax.Array  # [batch, kv_len] int32
    q_segment_ids: jax.Array | None = None  # [batch, q_len]; equal ids attend
    kv_segment_ids: jax.Array | None = None  # [batch, kv_len]
    causal: bool = dataclasses.field(default=True, metadata=dict(static=True))
    sliding_window: int | None = dataclasses.field(default=None, metadata=dict(static=True))
    linear_bias_slopes: jax.Array | None = None  # [heads] float32 (plugin API 1.1)
    # Soft cap of the scaled scores, cap * tanh(s / cap); None: uncapped.
    logit_softcap: float | None = dataclasses.field(default=None, metadata=dict(static=True))
    q_causal_limits: jax.Array | None = None  # [batch, q_len]; None: the q positions

    def dense(self) -> jax.Array:
        """Boolean [batch, 1, q_len, kv_len]: True where attention is allowed."""
        q = self.q_positions[:, :, None]
        k = self.kv_positions[:, None, :]
        allowed = jnp.ones(jnp.broadcast_shapes(q.shape, k.shape), dtype=bool)
        limits = self.q_causal_limits
        if self.causal:
            allowed &= k <= (q if limits is None else limits[:, :, None])
        if self.sliding_window is not None:
            allowed &= (q - k if self.causal else jnp.abs(q - k)) < self.sliding_window
        if self.q_segment_ids is not None and self.kv_segment_ids is not None:
            allowed &= self.q_segment_ids[:, :, None] == self.kv_segment_ids[:, None, :]
        return allowed[:, None]

    def bias(self) -> jax.Array | None:
        """Float32 [batch, heads, q_len, kv_len] added to the scaled scores, or None."""
        if self.linear_bias_slopes is None:
            return None
        return linear_bias(self.linear_bias_slopes, self.q_positions, self.kv_positions)


def linear_bias(slopes: jax.Array, q_positions: jax.Array, kv_positions: jax.Array) -> jax.Array:
    """`-slopes[h] * |q - kv|`: float32 [batch, heads, q_len, kv_len] (ALiBi's bias)."""
    distance = jnp.abs(q_positions[:, :, None] - kv_positions[:, None, :]).astype(jnp.float32)
    return -jnp.asarray(slopes, jnp.float32)[None, :, None, None] * distance[:, None]


class PagedKV(NamedTuple):
    """A paged cache's keys and values as a paged-attention kernel reads them: each row's
    first `lengths[b]` tokens, in the pages `block_table[b]` names, in logical order."""

    key_pages: jax.Array  # [kv_heads, num_pages, page_size, head_dim]
    value_pages: jax.Array
    block_table: jax.Array  # [batch, pages_per_row]; entries >= num_pages: no page
    lengths: jax.Array  # [batch] tokens cached per row (this step's included)
