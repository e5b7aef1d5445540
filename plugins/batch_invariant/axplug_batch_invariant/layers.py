"""Layers whose every token's result is computed in one order whatever shares its call:
token-wise work in tiles of exactly `TILE_ROWS` tokens, attention one query at a time over the
row's whole key axis (the same function for prefill, mixed and decode steps)."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from axplug.api import AttentionMask
from axplug.api.layers import (
    AttentionKernelSlot,
    Embedding,
    FeedForward,
    LayerNorm,
    Linear,
    RMSNorm,
)

__all__ = [
    "BatchInvariantEmbedding",
    "BatchInvariantKernel",
    "BatchInvariantFeedForward",
    "BatchInvariantLayerNorm",
    "BatchInvariantLinear",
    "BatchInvariantRMSNorm",
    "attend_each_query",
    "in_tiles",
    "tiled_matmul",
]

TILE_ROWS = 8


def in_tiles(fn, x: jax.Array, rows: int = TILE_ROWS) -> jax.Array:
    """`fn` (token-wise: [1, n, in] -> [1, n, out]) over x [..., in] as calls on exactly `rows`
    tokens (zero-padded): XLA:CPU picks how a reduction or a transcendental function is
    emitted by the shape and fusion of the whole op, so a token's bits would otherwise change
    with how many tokens share the call."""
    flat = x.reshape(-1, x.shape[-1])
    m = flat.shape[0]
    tiles = jnp.pad(flat, ((0, -m % rows), (0, 0))).reshape(-1, 1, rows, flat.shape[1])
    out = jax.lax.map(fn, tiles)  # each tile [1, rows, in]: a batch of one sequence
    return out.reshape(-1, out.shape[-1])[:m].reshape(*x.shape[:-1], out.shape[-1])


def tiled_matmul(x: jax.Array, w: jax.Array, rows: int = TILE_ROWS) -> jax.Array:
    """x [..., in] @ w [in, out] as matmuls of exactly `rows` rows (zero-padded): XLA picks a
    matmul's algorithm, and with it the order of each sum, by the matmul's shape, so a row's
    result would otherwise change with how many rows share the call."""
    return in_tiles(lambda tile: tile @ w, x, rows)


class _TokenwiseInTiles:
    """A token-wise layer whose `forward` runs `in_tiles`."""

    def forward(self, x: jax.Array) -> jax.Array:
        return in_tiles(super().forward, x)  # type: ignore[misc]


class BatchInvariantRMSNorm(_TokenwiseInTiles, RMSNorm):
    """`RMSNorm` over fixed tiles of tokens."""


class BatchInvariantLayerNorm(_TokenwiseInTiles, LayerNorm):
    """`LayerNorm` over fixed tiles of tokens."""


class BatchInvariantFeedForward(_TokenwiseInTiles, FeedForward):
    """`FeedForward` (its activation and projections) over fixed tiles of tokens."""


class BatchInvariantLinear(Linear):
    """`Linear` whose product is `tiled_matmul`: a token's output is the same bits whatever
    else is in the batch."""

    def project(self, x: jax.Array) -> jax.Array:
        params = self.parameters
        w = self.cast(params["weight"])
        y = tiled_matmul(self.cast(x), w)
        return y + self.cast(params["bias"]) if "bias" in params else y


class BatchInvariantEmbedding(Embedding):
    """`Embedding` whose tied output head (`attend`) is `tiled_matmul`."""

    def attend(self, x: jax.Array) -> jax.Array:
        w = self.cast(self.parameters["weight"]).T
        return tiled_matmul(self.cast(x), w)


def attend_each_query(q, k, v, allowed, *, scale, bias=None, logit_softcap=None) -> jax.Array:
    """softmax(q k^T) v for q [b, sq, h, d] over k, v [b, skv, kvh, d] (h % kvh == 0),
    `allowed` [b, sq, skv], `bias` [b, h, sq, skv] or None, one (row, query) per loop
    iteration: every query's sums run over its row's whole key axis in one order, the same
    for one query (decoding) as for many (prefill), in one row or many. A query with no
    allowed key gives zeros."""
    b, sq, h, d = q.shape
    group = h // k.shape[2]
    k32, v32 = (jnp.repeat(t, group, axis=2).astype(jnp.float32) for t in (k, v))
    each = {
        "q": q.astype(jnp.float32).reshape(b * sq, h, d),
        "row": jnp.repeat(jnp.arange(b), sq),
        "allowed": allowed.reshape(b * sq, -1),
    }
    if bias is not None:
        each["bias"] = bias.transpose(0, 2, 3, 1).reshape(b * sq, -1, h)  # [b * sq, skv, h]

    def one(query):  # [h, d] -> [h, dv]
        keys, values = k32[query["row"]], v32[query["row"]]  # [skv, h, d]
        scores = jnp.sum(query["q"][None] * keys, axis=-1) * scale  # [skv, h]
        if logit_softcap is not None:
            scores = logit_softcap * jnp.tanh(scores / logit_softcap)
        if "bias" in query:
            scores = scores + query["bias"]
        scores = jnp.where(query["allowed"][:, None], scores, -jnp.inf)
        top = jnp.max(scores, axis=0)
        probs = jnp.exp(scores - jnp.where(jnp.isfinite(top), top, 0.0))
        total = jnp.sum(probs, axis=0)  # [h]
        out = jnp.sum(probs[..., None] * values, axis=0)
        return out / jnp.where(total > 0, total, 1.0)[:, None]

    return jax.lax.map(one, each).reshape(b, sq, h, v.shape[-1]).astype(v.dtype)


class BatchInvariantKernel(AttentionKernelSlot):
    """Attention's kernel slot through `attend_each_query`, dense and paged: a query's output
    is the same bits in a prefill, a mixed or a decode step, from a shared or an own page."""

    def _scale(self, d: int) -> float:
        return self._config.scale if self._config.scale is not None else 1.0 / math.sqrt(d)

    def forward(self, q, k, v, mask: AttentionMask) -> jax.Array:
        return attend_each_query(
            q, k, v, mask.dense()[:, 0], scale=self._scale(q.shape[-1]), bias=mask.bias(),
            logit_softcap=mask.logit_softcap,
        )  # fmt: skip

    def paged_attention(self, q, paged, *, logit_softcap: float | None = None) -> jax.Array:
        """The rows' pages gathered in logical order, then as `forward` with one query."""
        key_pages, value_pages, table, lengths = paged
        kvh, _, page, d = key_pages.shape

        def rows(pool):  # [kvh, pages, page, d] -> [b, pages_per_row * page, kvh, d]
            taken = jnp.take(pool, table, axis=1, mode="fill", fill_value=0)
            return taken.reshape(kvh, table.shape[0], -1, d).transpose(1, 2, 0, 3)

        allowed = jnp.arange(table.shape[1] * page)[None, None, :] < lengths[:, None, None]
        out = attend_each_query(
            q[:, None], rows(key_pages), rows(value_pages), allowed, scale=self._scale(d),
            logit_softcap=logit_softcap,
        )  # fmt: skip
        return out[:, 0]
