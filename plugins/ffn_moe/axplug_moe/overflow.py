"""Expert FFNs over the rows past each expert's buffer, a tile of rows at a time.

Rows are choices sorted by expert. Expert e owns sorted positions [begin[e], begin[e] +
count[e]); its rows [first[e], last[e]) of those run here in tiles of `tile` rows, one
expert's weights per tile (the balanced buffer ran the rows before `first`). The loop runs
only the tiles there are (a dynamic trip count), reads each expert's weights in place (no
per-tile copies) and, in the backward pass, adds each tile's weight gradient into its
expert's slice in place. The forward keeps the hidden pre-activations, so the backward runs
the model's two matmuls per weight and no recompute.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp

__all__ = ["overflow_ffn", "overflow_tiles"]

Weights = tuple[jax.Array, jax.Array, jax.Array | None]  # wi_up, wo, wi_gate


def overflow_tiles(first: jax.Array, last: jax.Array, tile: int) -> tuple[jax.Array, jax.Array]:
    """(tiles per expert [e], cumulative end [e]) of each expert's rows [first, last)."""
    per_expert = (jnp.maximum(last - first, 0) + tile - 1) // tile
    return per_expert, jnp.cumsum(per_expert)


class _Tiles:
    """Where tile t's rows are, for a fixed routing."""

    def __init__(self, token, begin, first, last, tile, num_tokens):
        self.token, self.begin, self.first, self.last = token, begin, first, last
        self.tile, self.num_tokens = tile, num_tokens
        self.per_expert, self.end = overflow_tiles(first, last, tile)

    @property
    def num_tiles(self) -> jax.Array:
        return self.end[-1]

    def __call__(self, t):
        """(expert, first sorted position, valid rows [tile], their tokens [tile])."""
        expert = jnp.minimum(jnp.searchsorted(self.end, t, side="right"), self.end.shape[0] - 1)
        offset = self.first[expert] + (t - self.end[expert] + self.per_expert[expert]) * self.tile
        start = self.begin[expert] + offset
        valid = offset + jnp.arange(self.tile) < self.last[expert]
        token = jax.lax.dynamic_slice_in_dim(self.token, start, self.tile)
        return expert, start, valid, jnp.where(valid, token, self.num_tokens)


def _slice(a, start, size):
    return jax.lax.dynamic_slice_in_dim(a, start, size)


def _write(a, value, start, valid):
    old = _slice(a, start, valid.shape[0])
    new = jnp.where(valid.reshape(-1, *[1] * (a.ndim - 1)), value.astype(a.dtype), old)
    return jax.lax.dynamic_update_slice_in_dim(a, new, start, 0)


def _forward(x, weights: Weights, tiles: _Tiles, activation):
    w_up, w_out, w_gate = weights
    rows_total = tiles.token.shape[0]  # sorted positions, padded by at least a tile

    def body(t, carry):
        out, up, gate = carry
        expert, start, valid, token = tiles(t)
        pick = functools.partial(jax.lax.dynamic_index_in_dim, index=expert, keepdims=False)
        rows = x[token]
        u = rows @ pick(w_up)
        up = _write(up, u, start, valid)
        if w_gate is None:
            h = activation(u)
        else:
            gt = rows @ pick(w_gate)
            gate = _write(gate, gt, start, valid)
            h = activation(gt) * u
        out = _write(out, h @ pick(w_out), start, valid)
        return out, up, gate

    hidden = (rows_total, w_up.shape[-1])
    carry = (
        jnp.zeros((rows_total, x.shape[1]), x.dtype),
        jnp.zeros(hidden, x.dtype),
        None if w_gate is None else jnp.zeros(hidden, x.dtype),
    )
    return jax.lax.fori_loop(0, tiles.num_tiles, body, carry)


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7))
def overflow_ffn(
    x: jax.Array,
    weights: Weights,
    token: jax.Array,
    begin: jax.Array,
    first: jax.Array,
    last: jax.Array,
    tile: int,
    activation: Callable[[jax.Array], jax.Array],
) -> jax.Array:
    """[m + pad, dim]: at each sorted position in its expert's [first, last), the expert's
    FFN of its token; zeros elsewhere.

    x: [tokens + 1, dim], the last row zeros; token: [m + pad] token of each sorted
    position, padded (pad >= tile) with `tokens`; begin [e]: each expert's first sorted
    position; first, last [e]: the range of its rows (offsets from begin) to run.
    """
    tiles = _Tiles(token, begin, first, last, tile, x.shape[0] - 1)
    return _forward(x, weights, tiles, activation)[0]


def _overflow_fwd(x, weights, token, begin, first, last, tile, activation):
    tiles = _Tiles(token, begin, first, last, tile, x.shape[0] - 1)
    out, up, gate = _forward(x, weights, tiles, activation)
    return out, (x, weights, token, begin, first, last, up, gate)


def _overflow_bwd(tile, activation, residuals, g):
    x, weights, token, begin, first, last, up, gate = residuals
    tiles = _Tiles(token, begin, first, last, tile, x.shape[0] - 1)
    w_up, w_out, w_gate = weights

    def body(t, carry):
        dx, d_up, d_out, d_gate = carry
        expert, start, valid, rows_token = tiles(t)
        pick = functools.partial(jax.lax.dynamic_index_in_dim, index=expert, keepdims=False)

        def add(total, grad):
            return jax.lax.dynamic_update_index_in_dim(
                total, pick(total) + grad.astype(total.dtype), expert, 0
            )

        rows = x[rows_token]
        g_tile = jnp.where(valid[:, None], _slice(g, start, tile), 0).astype(x.dtype)
        u = _slice(up, start, tile)
        if w_gate is None:
            h, post = jax.vjp(activation, u)
        else:
            h, post = jax.vjp(lambda a, b: activation(a) * b, _slice(gate, start, tile), u)
        d_out = add(d_out, h.T @ g_tile)
        grads = post(g_tile @ pick(w_out).T)
        du = grads[-1]
        d_up = add(d_up, rows.T @ du)
        d_rows = du @ pick(w_up).T
        if w_gate is not None:
            d_gate = add(d_gate, rows.T @ grads[0])
            d_rows = d_rows + grads[0] @ pick(w_gate).T
        return dx.at[rows_token].add(d_rows), d_up, d_out, d_gate

    zeros = (
        jnp.zeros_like(x),
        jnp.zeros_like(w_up),
        jnp.zeros_like(w_out),
        None if w_gate is None else jnp.zeros_like(w_gate),
    )
    dx, d_up, d_out, d_gate = jax.lax.fori_loop(0, tiles.num_tiles, body, zeros)
    return dx, (d_up, d_out, d_gate), None, None, None, None


overflow_ffn.defvjp(_overflow_fwd, _overflow_bwd)
