"""Splash attention (`jax.experimental.pallas.ops.tpu.splash_attention`) as an axplug kernel.

Splash masks by *index*: causal means key index <= query index, which equals `AttentionMask`'s
position-based mask for self-attention over whole sequences (training, prefill). Decoding
(q_len != kv_len) is left to the XLA kernel. The kernel runs per batch element and kv head
(vmap). Mosaic calls cannot be partitioned by XLA, so under a multi-device sharding scope each
call runs per device on its batch rows (and heads) in a shard_map
(`axplug.kernels.shard_over_batch`); a sequence sharded over the `seq` mesh axis is declined, so
dispatch falls back to the XLA kernel, which is exact there.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp

from axplug.api import AttentionKernel, Unsupported, check_shapes
from axplug.api.kernels import check_sequence_sharding, shard_over_batch

__all__ = ["SplashAttentionKernel"]

_SPLASH_ERROR: str | None
try:  # guarded: the plugin imports on any jaxlib
    from jax.experimental.pallas.ops.tpu import splash_attention as _splash
except Exception as exc:  # noqa: BLE001
    _splash, _SPLASH_ERROR = None, f"{type(exc).__name__}: {exc}"  # type: ignore[assignment]
else:
    _SPLASH_ERROR = None


class SplashAttentionKernel(AttentionKernel):
    """Splash (sparse flash) attention on TPU: causal, sliding-window, full; segment ids; GQA."""

    priority = 120
    dtypes = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32))
    block = 128
    # True runs the Pallas interpreter (any backend, slow): how the CPU tests check numerics.
    interpret = False

    def availability(self, backend: str | None = None) -> str | None:
        """None when this kernel can run on `backend` (default: jax's), else why not."""
        if _splash is None:
            return f"splash attention not importable: {_SPLASH_ERROR}"
        backend = backend or jax.default_backend()
        return None if backend == "tpu" else f"needs a TPU; this machine's backend is {backend!r}"

    def is_supported(self, query, key, value, mask, backend):
        if _splash is None:
            return Unsupported(f"splash attention not importable: {_SPLASH_ERROR}")
        if backend != "tpu":
            return Unsupported(f"needs the TPU backend, not {backend!r}")
        if (problem := check_shapes(query, key, value)) is not None:
            return problem
        if not query.dtype == key.dtype == value.dtype:
            return Unsupported("q, k, v dtypes differ")
        if query.dtype not in self.dtypes:
            return Unsupported(f"dtype {query.dtype} (needs bfloat16/float32)")
        sq, skv, d = query.shape[1], key.shape[1], query.shape[-1]
        if sq != skv:
            return Unsupported("q_len != kv_len (decoding): index-based masks would be wrong")
        if sq % self.block:
            return Unsupported(f"seq {sq} not a multiple of the {self.block} block")
        if d % 128:
            return Unsupported(f"head_dim {d} not a multiple of 128 (TPU lane width)")
        if mask.sliding_window is not None and not mask.causal:
            return Unsupported("a non-causal sliding window")
        if mask.linear_bias_slopes is not None:
            return Unsupported("a score bias (splash masks scores, it adds none)")
        if getattr(mask, "logit_softcap", None) is not None:
            return Unsupported("logit soft-capping (not passed to splash)")
        problem = check_sequence_sharding(query)
        return True if problem is None else problem

    def __call__(self, query, key, value, mask, *, scale):
        return shard_over_batch(self.attend, query, key, value, mask, scale=scale)

    def attend(self, query, key, value, mask, *, scale):
        """The Splash call on one device's operands (what `__call__` runs per shard)."""
        b, s, h, d = query.shape
        kvh = key.shape[2]
        group = h // kvh
        kernel = _make_kernel(s, group, mask.causal, mask.sliding_window, self.interpret)
        q = (query * scale).astype(query.dtype)
        q = q.reshape(b, s, kvh, group, d).transpose(0, 2, 3, 1, 4)  # [b, kvh, group, s, d]
        k = key.transpose(0, 2, 1, 3)  # [b, kvh, s, d]
        v = value.transpose(0, 2, 1, 3)
        if mask.q_segment_ids is None:
            per_head = jax.vmap(kernel)  # over kv heads
            out = jax.vmap(per_head)(q, k, v)
        else:

            def one(q, k, v, qs, ks):
                ids = _splash.SegmentIds(q=qs, kv=ks)
                return jax.vmap(lambda q, k, v: kernel(q, k, v, segment_ids=ids))(q, k, v)

            out = jax.vmap(one)(q, k, v, mask.q_segment_ids, mask.kv_segment_ids)
        # out [b, kvh, group, s, d] -> [b, s, h, d]
        return out.transpose(0, 3, 1, 2, 4).reshape(b, s, h, d).astype(value.dtype)


@functools.lru_cache(maxsize=64)
def _make_kernel(seq: int, group: int, causal: bool, window: int | None, interpret: bool):
    """One MQA splash kernel: q [group, seq, d] against k, v [seq, d]."""
    shape = (seq, seq)
    if window is not None:
        one: Any = _splash.LocalMask(shape, window_size=(window - 1, 0), offset=0)
    elif causal:
        one = _splash.CausalMask(shape)
    else:
        one = _splash.FullMask(shape)
    heads = _splash.MultiHeadMask([one] * group)
    return _splash.make_splash_mqa_single_device(mask=heads, interpret=interpret)
