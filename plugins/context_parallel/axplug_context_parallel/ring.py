"""Ring attention: each device keeps its queries and passes its keys and values around the
`seq` mesh axis, one block per step, merging the blocks' outputs by their log-sum-exp.

Runs inside a shard_map over the `seq` axis: every argument is one device's shard. A step's
block work is the kernel's `forward_lse` / `backward_lse` (plugin API: `supports_lse`), so a
flash kernel runs it where one exists. The backward pass is a custom VJP: each block's
probabilities are recomputed from the merged log-sum-exp, and the keys' gradients travel the
ring with their keys, so no step keeps a block's scores or its keys for the backward pass.

Causal masks skip the blocks that lie wholly in the future (`Skip`): where the tokens are in
zigzag order (`axplug_context_parallel.layout`), every device computes one diagonal block and
n - 1 half blocks, equal work on every device. Which keys are allowed always comes from the
mask's positions and segments; the skipping assumes only that, within a segment, a later token
never sits at an earlier position (packed documents, decoding offsets).
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from axplug.api import AttentionMask

__all__ = ["Skip", "ring_attention", "ring_work"]


class Skip(enum.Enum):
    """Which part of a block a device computes, by where the block's keys lie."""

    NONE = "none"  # not causal: every block whole
    CONTIGUOUS = "contiguous"  # causal, device d holds tokens [d c, (d + 1) c): past blocks whole
    ZIGZAG = "zigzag"  # causal, device d holds chunks d and 2n - 1 - d of 2n: half blocks


def ring_work(ways: int, skip: Skip) -> np.ndarray:
    """[ways] query-key pairs each device computes (one token per chunk of 2 * ways), its
    attention FLOPs up to a constant: the load each device carries in the ring."""
    full, half = 4, 2  # a whole block of 2 x 2 chunks; half of one
    work = np.zeros(ways, np.int64)
    for i in range(ways):
        for step in range(ways):
            j = (i - step) % ways
            if skip is Skip.NONE or j == i:
                work[i] += full
            elif skip is Skip.ZIGZAG:
                work[i] += half
            elif j < i:  # contiguous: blocks of later devices' keys are skipped
                work[i] += full
    return work


@dataclasses.dataclass(frozen=True)
class _Ring:
    axis: Any  # the mesh axis (or axes) of `seq`
    ways: int  # devices in a ring
    kernel: Any  # an attention kernel with forward_lse / backward_lse
    scale: float
    skip: Skip
    stride: int = 1  # a ring's devices are `stride` apart on the axis (rings side by side)

    def rotate(self, tree):
        """`tree` from each device to the next along its ring."""
        n = self.ways * self.stride
        perm = [(d, (d + self.stride) % n) for d in range(n)]
        return jax.tree.map(lambda x: jax.lax.ppermute(x, self.axis, perm), tree)

    def case(self, step) -> jax.Array:
        """0: the device's own keys (the diagonal); 1: an earlier device's; 2: a later's."""
        i = jax.lax.axis_index(self.axis) // self.stride
        j = (i - step) % self.ways
        return jnp.where(step == 0, 0, jnp.where(j < i, 1, 2))

    def parts(self, case: int, sq: int, skv: int) -> tuple[slice, slice] | None:
        """(query slice, key slice) a block computes in `case` (of `case()`), None: nothing."""
        whole = (slice(0, sq), slice(0, skv))
        if case == 0 or self.skip is Skip.NONE:
            return whole
        if self.skip is Skip.CONTIGUOUS:
            return whole if case == 1 else None
        # Zigzag: an earlier device's first chunk is in the past of both query chunks and its
        # second in their future; a later device's keys are all in the second chunk's past
        # and all in the first's future.
        if case == 1:
            return slice(0, sq), slice(0, skv // 2)
        return slice(sq // 2, sq), slice(0, skv)


def _block_mask(mask: AttentionMask, kv, q_part: slice, kv_part: slice) -> AttentionMask:
    _, _, kv_pos, kv_seg = kv
    return dataclasses.replace(
        mask,
        q_positions=mask.q_positions[:, q_part],
        kv_positions=kv_pos[:, kv_part],
        q_segment_ids=None if mask.q_segment_ids is None else mask.q_segment_ids[:, q_part],
        kv_segment_ids=None if kv_seg is None else kv_seg[:, kv_part],
    )


def _forward_block(ring: _Ring, q, kv, mask, case: int):
    """(out f32 [b, sq, h, dv], lse [b, sq, h]) of `q` over the keys of `kv` in `case`."""
    k, v = kv[0], kv[1]
    b, sq, h = q.shape[:3]
    out = jnp.zeros((b, sq, h, v.shape[-1]), jnp.float32)
    lse = jnp.full((b, sq, h), -jnp.inf, jnp.float32)
    parts = ring.parts(case, sq, k.shape[1])
    if parts is None:
        return out, lse
    qp, kp = parts
    o, s = ring.kernel.forward_lse(
        q[:, qp], k[:, kp], v[:, kp], _block_mask(mask, kv, qp, kp), scale=ring.scale
    )
    return out.at[:, qp].set(o), lse.at[:, qp].set(s)


def _merge(out, lse, block_out, block_lse):
    """Two attention results over disjoint keys, as one over their union."""
    merged = jnp.logaddexp(lse, block_lse)
    # A row that neither part has computed stays -inf: weigh it 0, not NaN.
    safe = jnp.where(jnp.isfinite(merged), merged, 0.0)
    weight = lambda s: jnp.exp(s - safe)[..., None]  # noqa: E731
    return out * weight(lse) + block_out * weight(block_lse), merged


def _switch(ring: _Ring, step, fn):
    """`fn(case)` for the case of `step` on this device (a static case where one is known)."""
    if ring.skip is Skip.NONE:
        return fn(0)
    return jax.lax.switch(ring.case(step), [lambda: fn(0), lambda: fn(1), lambda: fn(2)])


def _ring_forward(ring: _Ring, q, k, v, mask):
    kv = (k, v, mask.kv_positions, mask.kv_segment_ids)
    out, lse = _forward_block(ring, q, kv, mask, 0)

    def step(carry, s):
        out, lse, kv = carry
        kv = ring.rotate(kv)
        block = _switch(ring, s, lambda case: _forward_block(ring, q, kv, mask, case))
        out, lse = _merge(out, lse, *block)
        return (out, lse, kv), None

    (out, lse, _), _ = jax.lax.scan(step, (out, lse, kv), jnp.arange(1, ring.ways))
    return out, lse


def _backward_block(ring: _Ring, q, kv, mask, out, lse, d_out, case: int):
    """(dq, dk, dv) float32 of the block of `case`: the part of the gradients its keys give."""
    k, v = kv[0], kv[1]
    dq = jnp.zeros(q.shape, jnp.float32)
    dk, dv = jnp.zeros(k.shape, jnp.float32), jnp.zeros(v.shape, jnp.float32)
    parts = ring.parts(case, q.shape[1], k.shape[1])
    if parts is None:
        return dq, dk, dv
    qp, kp = parts
    block_mask = _block_mask(mask, kv, qp, kp)
    gq, gk, gv = ring.kernel.backward_lse(
        q[:, qp], k[:, kp], v[:, kp], block_mask, out[:, qp], lse[:, qp], d_out[:, qp],
        scale=ring.scale,
    )  # fmt: skip
    return dq.at[:, qp].set(gq), dk.at[:, kp].set(gk), dv.at[:, kp].set(gv)


def _ring_backward(ring: _Ring, q, k, v, mask, out, lse, d_out):
    kv = (k, v, mask.kv_positions, mask.kv_segment_ids)
    dq, dk, dv = _backward_block(ring, q, kv, mask, out, lse, d_out, 0)

    def step(carry, s):
        dq, kv, dkv = carry
        kv, dkv = ring.rotate((kv, dkv))  # each block's gradients travel with it
        grads = _switch(
            ring, s, lambda case: _backward_block(ring, q, kv, mask, out, lse, d_out, case)
        )
        return (dq + grads[0], kv, (dkv[0] + grads[1], dkv[1] + grads[2])), None

    (dq, _, dkv), _ = jax.lax.scan(step, (dq, kv, (dk, dv)), jnp.arange(1, ring.ways))
    dk, dv = ring.rotate(dkv)  # one step more: home
    return dq, dk, dv


def _zero_cotangent(x):
    if jnp.issubdtype(x.dtype, jnp.floating):
        return jnp.zeros_like(x)
    return np.zeros(x.shape, jax.dtypes.float0)


def ring_attention(
    query, key, value, mask, *, scale, axis, ways, kernel, skip: Skip, stride: int = 1
):
    """One device's attention output [b, sq, h, dv] (value's dtype) for its `query` shard
    over every device's keys, inside a shard_map over `axis`: a ring of `ways` devices, or
    with `stride` s, s rings side by side (devices d, d + s, ...), each its own sequence."""
    ring = _Ring(axis, ways, kernel, float(scale), skip, stride)

    @jax.custom_vjp
    def attend(q, k, v, mask):
        return _ring_forward(ring, q, k, v, mask)[0].astype(v.dtype)

    def forward(q, k, v, mask):
        out, lse = _ring_forward(ring, q, k, v, mask)
        return out.astype(v.dtype), (q, k, v, mask, out, lse)

    def backward(residuals, d_out):
        q, k, v, mask, out, lse = residuals
        dq, dk, dv = _ring_backward(ring, q, k, v, mask, out, lse, d_out.astype(jnp.float32))
        d_mask = jax.tree.map(_zero_cotangent, mask)
        return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), d_mask

    attend.defvjp(forward, backward)
    return attend(query, key, value, mask)
