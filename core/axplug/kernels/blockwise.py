"""Memory-efficient attention in plain JAX: blocks of keys with an online softmax.

The forward pass scans over key/value blocks, keeping a running max, sum and output per query,
so it never holds more than [queries, block] scores; it saves only the output and the
log-sum-exp. The backward pass (a custom VJP) recomputes each block's probabilities from the
log-sum-exp, as flash attention does. Memory is O(seq * block) instead of O(seq^2); FLOPs are
those of the plain kernel plus the recompute. Masks come from positions and segment ids, so
packed sequences, sliding windows, GQA, decoding offsets, a linear (ALiBi) score bias and
logit soft-capping all work, on every backend.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from axplug.api import AttentionKernel, Unsupported, check_shapes
from axplug.kernels.reference import NEG_INF

__all__ = [
    "BlockwiseKernel",
    "blockwise_attention",
    "blockwise_backward_lse",
    "blockwise_forward_lse",
]

_PAD = -jnp.inf  # padding keys beyond the sequence: never attended, even by fully masked rows


def _allowed(q_pos, kv_pos, q_seg, kv_seg, causal, window):
    """Boolean [b, 1, 1, sq, block] (broadcast over kv heads and groups)."""
    q, k = q_pos[:, :, None], kv_pos[:, None, :]
    ok = jnp.ones(jnp.broadcast_shapes(q.shape, k.shape), bool)
    if causal:
        ok &= k <= q
    if window is not None:
        ok &= jnp.abs(q - k) < window
    if q_seg is not None:
        ok &= q_seg[:, :, None] == kv_seg[:, None, :]
    return ok[:, None, None]


def _scores(q, k, scale, mask_args, valid, causal, window, slopes, cap):
    """(masked f32 scores [b, kvh, g, sq, block] of grouped q against one key block, and
    tanh(s / cap) of the scaled scores when `cap` soft-caps them, else None); slopes
    ([kvh, g] or None) add the linear distance bias after the cap."""
    s = jnp.einsum("bqngd,bknd->bngqk", q, k, preferred_element_type=jnp.float32) * scale
    t = None
    if cap is not None:
        t = jnp.tanh(s / cap)
        s = cap * t
    if slopes is not None:
        q_pos, kv_pos = mask_args[0], mask_args[1]
        distance = jnp.abs(q_pos[:, :, None] - kv_pos[:, None, :]).astype(jnp.float32)
        s = s - slopes[None, :, :, None, None] * distance[:, None, None]
    s = jnp.where(_allowed(*mask_args, causal, window), s, NEG_INF)
    return jnp.where(valid[:, None, None, None, :], s, _PAD), t


def _blocks(x, block):
    """[b, s, ...] -> [s // block, b, block, ...] (the scan axis first)."""
    b, s = x.shape[:2]
    return jnp.moveaxis(x.reshape(b, s // block, block, *x.shape[2:]), 1, 0)


def _key_blocks(k, v, kv_pos, valid, kv_seg, block):
    """The scanned-over key-side arrays, blocked (no segment ids: None, an empty pytree)."""
    return tuple(None if x is None else _blocks(x, block) for x in (k, v, kv_pos, valid, kv_seg))


def _unblocks(x):
    n, b, block = x.shape[:3]
    return jnp.moveaxis(x, 0, 1).reshape(b, n * block, *x.shape[3:])


def _forward(
    q, k, v, q_pos, kv_pos, q_seg, kv_seg, valid, slopes, *, scale, causal, window, block, cap
):
    """(out [b, sq, kvh, g, dv] f32, lse [b, kvh, g, sq]); dv, the value head_dim, may differ
    from q's and k's (MLA)."""
    b, sq, kvh, g, _ = q.shape
    d = v.shape[-1]
    xs = _key_blocks(k, v, kv_pos, valid, kv_seg, block)

    def step(carry, blk):
        m, total, acc = carry
        kb, vb, pb, validb, segb = blk
        s, _ = _scores(q, kb, scale, (q_pos, pb, q_seg, segb), validb, causal, window, slopes, cap)
        m_new = jnp.maximum(m, s.max(-1))
        p = jnp.exp(s - m_new[..., None])
        correction = jnp.exp(m - m_new)
        total = total * correction + p.sum(-1)
        pv = jnp.einsum(
            "bngqk,bknd->bqngd", p.astype(vb.dtype), vb, preferred_element_type=jnp.float32
        )
        acc = acc * jnp.moveaxis(correction, 3, 1)[..., None] + pv
        return (m_new, total, acc), None

    init = (
        jnp.full((b, kvh, g, sq), -jnp.inf, jnp.float32),
        jnp.zeros((b, kvh, g, sq), jnp.float32),
        jnp.zeros((b, sq, kvh, g, d), jnp.float32),
    )
    (m, total, acc), _ = jax.lax.scan(step, init, xs)
    out = acc / jnp.moveaxis(total, 3, 1)[..., None]
    return out, m + jnp.log(total)


@functools.partial(jax.custom_vjp, nondiff_argnums=(9, 10, 11, 12, 13))
def _attention(
    q, k, v, q_pos, kv_pos, q_seg, kv_seg, valid, slopes, scale, causal, window, block, cap
):
    out, _ = _forward(
        q, k, v, q_pos, kv_pos, q_seg, kv_seg, valid, slopes,
        scale=scale, causal=causal, window=window, block=block, cap=cap,
    )  # fmt: skip
    return out.astype(v.dtype)


def _attention_fwd(
    q, k, v, q_pos, kv_pos, q_seg, kv_seg, valid, slopes, scale, causal, window, block, cap
):
    out, lse = _forward(
        q, k, v, q_pos, kv_pos, q_seg, kv_seg, valid, slopes,
        scale=scale, causal=causal, window=window, block=block, cap=cap,
    )  # fmt: skip
    out = out.astype(v.dtype)
    return out, (q, k, v, q_pos, kv_pos, q_seg, kv_seg, valid, slopes, out, lse)


def _attention_bwd(scale, causal, window, block, cap, residuals, d_out):
    *inputs, out, lse = residuals
    return _backward(*inputs, out, lse, d_out, scale, causal, window, block, cap)


def _backward(
    q, k, v, q_pos, kv_pos, q_seg, kv_seg, valid, slopes, out, lse, d_out,
    scale, causal, window, block, cap,
):  # fmt: skip
    """The cotangents of `_attention`'s inputs, each block's probabilities recomputed from
    the log-sum-exp `lse` of the whole key set (which may hold more blocks than `k`'s)."""
    d_out = d_out.astype(jnp.float32)
    # delta = rowsum(dO * O): the softmax's Jacobian term, [b, kvh, g, sq].
    delta = jnp.moveaxis(jnp.sum(d_out * out.astype(jnp.float32), -1), 1, 3)
    xs = _key_blocks(k, v, kv_pos, valid, kv_seg, block)

    def step(dq, blk):
        kb, vb, pb, validb, segb = blk
        s, t = _scores(q, kb, scale, (q_pos, pb, q_seg, segb), validb, causal, window, slopes, cap)
        p = jnp.exp(s - lse[..., None])  # [b, n, g, sq, block]
        dv = jnp.einsum("bngqk,bqngd->bknd", p, d_out)
        dp = jnp.einsum("bqngd,bknd->bngqk", d_out, vb.astype(jnp.float32))
        if t is None:
            ds = p * (dp - delta[..., None]) * scale
        else:  # through the cap: d(cap tanh(s / cap)) / ds = 1 - tanh^2
            ds = p * (dp - delta[..., None]) * (1.0 - t * t) * scale
        dq = dq + jnp.einsum("bngqk,bknd->bqngd", ds, kb.astype(jnp.float32))
        dk = jnp.einsum("bngqk,bqngd->bknd", ds, q.astype(jnp.float32))
        return dq, (dk, dv)

    dq, (dk, dv) = jax.lax.scan(step, jnp.zeros(q.shape, jnp.float32), xs)
    ints = (q_pos, kv_pos, q_seg, kv_seg, valid)
    zeros = tuple(None if a is None else np.zeros(a.shape, jax.dtypes.float0) for a in ints)
    dk, dv = _unblocks(dk), _unblocks(dv)
    # The bias slopes are constants of the model (ALiBi's are fixed): no gradient.
    d_slopes = None if slopes is None else jnp.zeros_like(slopes)
    return (dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), *zeros, d_slopes)


# optimize_remat: under a layer remat policy that saves dots (`dots`), recomputing the
# residuals would save every block's scores from the first forward: O(seq^2) again.
_attention.defvjp(_attention_fwd, _attention_bwd, optimize_remat=True)


def _operands(query, key, value, mask, block):
    """`_attention`'s array operands and static settings for a call, keys padded to blocks."""
    b, sq, h, d = query.shape
    skv, kvh = key.shape[1], key.shape[2]
    block = min(block, skv)
    pad = -skv % block
    valid = jnp.ones((b, skv), bool)
    kv_pos, kv_seg = mask.kv_positions, mask.kv_segment_ids
    if pad:
        widen = lambda x: jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))  # noqa: E731
        key, value, valid, kv_pos = widen(key), widen(value), widen(valid), widen(kv_pos)
        kv_seg = None if kv_seg is None else widen(kv_seg)
    q = query.reshape(b, sq, kvh, h // kvh, d)
    slopes = mask.linear_bias_slopes
    if slopes is not None:
        slopes = jnp.asarray(slopes, jnp.float32).reshape(kvh, h // kvh)
    arrays = (q, key, value, mask.q_positions, kv_pos, mask.q_segment_ids, kv_seg, valid, slopes)
    cap = None if mask.logit_softcap is None else float(mask.logit_softcap)
    return arrays, (mask.causal, mask.sliding_window, block, cap)


def blockwise_attention(query, key, value, mask, *, scale: float, block: int = 512) -> jax.Array:
    """Attention of `query` [b, sq, h, d] over `key` [b, skv, kvh, d] and `value`
    [b, skv, kvh, dv] under `mask` (an `AttentionMask`), `block` keys at a time; equals the
    reference kernel."""
    arrays, settings = _operands(query, key, value, mask, block)
    out = _attention(*arrays, float(scale), *settings)
    return out.reshape(*query.shape[:3], value.shape[-1])


def blockwise_forward_lse(query, key, value, mask, *, scale: float, block: int = 512):
    """(out [b, sq, h, dv] float32, lse [b, sq, h] float32): `blockwise_attention`'s output
    and each query's log-sum-exp of its scores, for merging attention over parts of the keys
    (`AttentionKernel.forward_lse`). Not differentiable: `blockwise_backward_lse` is its VJP."""
    arrays, (causal, window, block, cap) = _operands(query, key, value, mask, block)
    out, lse = _forward(
        *arrays, scale=float(scale), causal=causal, window=window, block=block, cap=cap
    )
    b, sq, h = query.shape[:3]
    return out.reshape(b, sq, h, value.shape[-1]), jnp.moveaxis(lse, 3, 1).reshape(b, sq, h)


def blockwise_backward_lse(query, key, value, mask, out, lse, d_out, *, scale, block=512):
    """(dq, dk, dv) float32 of the attention whose output over all keys is `out` and
    log-sum-exp `lse` (`blockwise_forward_lse`'s, merged), for the part of the keys in
    `key`/`value`: summed over the parts they are the whole gradients."""
    arrays, settings = _operands(query, key, value, mask, block)
    b, sq, kvh, g, _ = arrays[0].shape
    grouped = lambda x: x.reshape(b, sq, kvh, g, x.shape[-1])  # noqa: E731
    lse = jnp.moveaxis(lse.reshape(b, sq, kvh, g), 1, 3)
    f32 = [x.astype(jnp.float32) if x is not None else x for x in arrays[:3]]
    dq, dk, dv, *_ = _backward(
        *f32, *arrays[3:], grouped(out), lse, grouped(d_out), float(scale), *settings
    )
    skv = key.shape[1]
    return dq.reshape(query.shape), dk[:, :skv], dv[:, :skv]


class BlockwiseKernel(AttentionKernel):
    """`blockwise_attention`: O(seq) memory on any backend; long sequences only, where the
    plain XLA kernel's [b, h, s, s] scores dominate memory (short ones run faster plain)."""

    priority = 20
    supports_linear_bias = True  # AttentionMask.linear_bias_slopes (plugin API 1.1)
    supports_logit_softcap = True  # AttentionMask.logit_softcap
    supports_lse = True  # forward_lse / backward_lse
    block = 512
    # Measured on 2 CPU cores (fwd+bwd, 8 heads of 32, 4096 tokens a batch): 0.64-1.13x the
    # XLA kernel's time from 512 to 4096 keys, noisy at 1024; short sequences stay plain.
    min_kv_len = 1024

    def is_supported(self, query, key, value, mask, backend):
        if (problem := check_shapes(query, key, value)) is not None:
            return problem
        if not jnp.issubdtype(query.dtype, jnp.floating):
            return Unsupported(f"dtype {query.dtype} is not floating point")
        if key.shape[1] < self.min_kv_len:
            return Unsupported(
                f"{key.shape[1]} keys < {self.min_kv_len}: the XLA kernel is faster there"
            )
        return True

    def __call__(self, query, key, value, mask, *, scale):
        return blockwise_attention(query, key, value, mask, scale=scale, block=self.block)

    def forward_lse(self, query, key, value, mask, *, scale):
        return blockwise_forward_lse(query, key, value, mask, scale=scale, block=self.block)

    def backward_lse(self, query, key, value, mask, out, lse, d_out, *, scale):
        return blockwise_backward_lse(
            query, key, value, mask, out, lse, d_out, scale=scale, block=self.block
        )
