"""The NKI flash attention of the Neuron compiler (`neuronxcc.nki.kernels.attention`: `flash_fwd`
and `flash_attn_bwd`) called from JAX through `jax_neuronx.nki_call`, when both are importable.

The forward saves the logsumexp that `flash_fwd` returns in training mode, and the backward runs
`flash_attn_bwd` on it (a `jax.custom_vjp`), so neither pass materializes the [seq, seq] scores.
GQA repeats the kv heads to the query heads before the kernels (the backward kernel takes equal
heads), and JAX sums their gradients back. Masks are by index (see the GPU/TPU plugins), so only
whole-sequence self-attention is accepted. Under a multi-device sharding scope each call runs
per device on its batch rows (and heads) in a shard_map (`axplug.kernels.shard_over_batch`).

Not yet run on Trainium: the kernel signatures and layouts follow neuronxcc's
`nki.kernels.attention` (q, k [b, h, d, s]; v [b, h, s, d] forward, [b, h, d, s] backward; lse
[b, h, 128, s // 128] float32), and the wiring is tested on CPU with jnp stand-ins for the two
kernels; the `neuron`-marked test in tests/test_hw_plugins.py is the check to run on a device.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from axplug.api import AttentionKernel, Unsupported, check_shapes
from axplug.api.kernels import check_sequence_sharding, shard_over_batch

__all__ = ["NkiFlashKernel", "NkiKernels", "NEURON_BACKENDS", "NKI"]

NEURON_BACKENDS = ("neuron",)
_PMAX = 128  # nl.tile_size.pmax: the partition dim of the logsumexp layout


class NkiKernels(NamedTuple):
    """What the kernel launches: `call(kernel, *args, grid=, out_shape=)` and the NKI kernels."""

    call: Any  # jax_neuronx.nki_call
    flash_fwd: Any  # neuronxcc.nki.kernels.attention.flash_fwd
    flash_attn_bwd: Any  # neuronxcc.nki.kernels.attention.flash_attn_bwd
    flash_config: Any  # neuronxcc.nki.kernels.attention.FlashConfig


_NKI_ERROR: str | None
try:  # guarded: neither package exists off Trainium
    from jax_neuronx import nki_call as _nki_call
    from neuronxcc.nki.kernels.attention import FlashConfig as _FlashConfig
    from neuronxcc.nki.kernels.attention import flash_attn_bwd as _flash_attn_bwd
    from neuronxcc.nki.kernels.attention import flash_fwd as _nki_flash_fwd
except Exception as exc:  # noqa: BLE001
    NKI: NkiKernels | None = None
    _NKI_ERROR = f"jax-neuronx / neuronx-cc not importable ({type(exc).__name__}: {exc})"
else:
    NKI = NkiKernels(_nki_call, _nki_flash_fwd, _flash_attn_bwd, _FlashConfig)
    _NKI_ERROR = None


class NkiFlashKernel(AttentionKernel):
    """NKI flash attention on NeuronCores: causal or full masks, bf16, seq a multiple of 512."""

    priority = 120
    tile = 512
    # The kernels launched; None when jax-neuronx / neuronx-cc are missing (tests inject).
    nki: NkiKernels | None = NKI

    def availability(self, backend: str | None = None) -> str | None:
        """None when this kernel can run on `backend` (default: jax's), else why not."""
        if self.nki is None:
            return _NKI_ERROR
        backend = backend or jax.default_backend()
        return None if backend in NEURON_BACKENDS else f"needs Trainium; backend is {backend!r}"

    def is_supported(self, query, key, value, mask, backend):
        if self.nki is None:
            return Unsupported(_NKI_ERROR or "jax-neuronx / neuronx-cc not importable")
        return self._check(query, key, value, mask, backend)

    def _check(self, query, key, value, mask, backend):
        """The gate without the import check (tested on machines without the packages)."""
        if backend not in NEURON_BACKENDS:
            return Unsupported(f"needs the neuron backend, not {backend!r}")
        if (problem := check_shapes(query, key, value)) is not None:
            return problem
        if not query.dtype == key.dtype == value.dtype == jnp.bfloat16:
            return Unsupported(f"dtype {query.dtype} (needs bfloat16 q, k, v)")
        sq, skv, d = query.shape[1], key.shape[1], query.shape[-1]
        if sq != skv:
            return Unsupported("q_len != kv_len (decoding): index-based masks would be wrong")
        if sq % self.tile:
            return Unsupported(f"seq {sq} not a multiple of the {self.tile} tile")
        if d > 128:
            return Unsupported(f"head_dim {d} > 128")
        if mask.sliding_window is not None:
            return Unsupported("sliding window")
        if mask.q_segment_ids is not None:
            return Unsupported("segment ids (packed sequences)")
        if mask.linear_bias_slopes is not None:
            return Unsupported("a score bias (the NKI flash kernel takes none)")
        if getattr(mask, "logit_softcap", None) is not None:
            return Unsupported("logit soft-capping (not passed to the NKI flash kernel)")
        problem = check_sequence_sharding(query)
        return True if problem is None else problem

    def __call__(self, query, key, value, mask, *, scale):
        return shard_over_batch(self.attend, query, key, value, mask, scale=scale)

    def attend(self, query, key, value, mask, *, scale):
        """The NKI calls on one device's operands (what `__call__` runs per shard)."""
        if self.nki is None:
            raise RuntimeError(f"NkiFlashKernel cannot run here: {_NKI_ERROR}")
        group = query.shape[2] // key.shape[2]
        if group > 1:  # flash_attn_bwd takes as many kv heads as query heads
            key, value = jnp.repeat(key, group, axis=2), jnp.repeat(value, group, axis=2)
        return _flash(query, key, value, self.nki, mask.causal, float(scale))


def _seq_tile(seq: int) -> int:
    """flash_fwd's kv tile (FlashConfig.seq_tile_size): the largest of 2048/1024/512 dividing
    `seq`, which must be a multiple of its tile."""
    return next(t for t in (2048, 1024, 512) if seq % t == 0)


def _forward(query, key, value, nki: NkiKernels, causal: bool, scale: float):
    """(out [b, s, h, d], lse [b, h, 128, s // 128]) from flash_fwd in training mode."""
    b, s, h, d = query.shape
    kernel = functools.partial(
        nki.flash_fwd,
        softmax_scale=scale,
        use_causal_mask=causal,
        mixed_precision=True,
        dropout_p=0.0,
        config=nki.flash_config(seq_tile_size=_seq_tile(s), training=True),
    )
    out, lse = nki.call(
        kernel,
        query.transpose(0, 2, 3, 1),  # [b, h, d, s]
        key.transpose(0, 2, 3, 1),  # [b, h, d, s]
        value.transpose(0, 2, 1, 3),  # [b, h, s, d]
        jnp.zeros((1,), jnp.int32),  # dropout seed (unused: dropout_p=0)
        grid=(b, h),
        out_shape=(
            jax.ShapeDtypeStruct((b, h, s, d), query.dtype),
            jax.ShapeDtypeStruct((b, h, _PMAX, s // _PMAX), jnp.float32),
        ),
    )
    return out.transpose(0, 2, 1, 3), lse


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _flash(query, key, value, nki: NkiKernels, causal: bool, scale: float):
    return _forward(query, key, value, nki, causal, scale)[0]


def _flash_fwd(query, key, value, nki, causal, scale):
    out, lse = _forward(query, key, value, nki, causal, scale)
    return out, (query, key, value, out, lse)


def _flash_bwd(nki, causal, scale, residuals, grad):
    query, key, value, out, lse = residuals
    b, s, h, d = query.shape
    kernel = functools.partial(
        nki.flash_attn_bwd,
        use_causal_mask=causal,
        mixed_precision=True,  # lse is float32, as flash_fwd wrote it
        dropout_p=0.0,
        softmax_scale=scale,
    )
    to_bhds = lambda x: x.transpose(0, 2, 3, 1)  # noqa: E731 - [b, s, h, d] -> [b, h, d, s]
    grads = nki.call(
        kernel,
        to_bhds(query),
        to_bhds(key),
        to_bhds(value),
        to_bhds(out),
        to_bhds(grad.astype(out.dtype)),
        lse,
        jnp.zeros((1,), jnp.int32),  # dropout seed (unused)
        grid=(b, h),
        out_shape=tuple(jax.ShapeDtypeStruct((b, h, d, s), query.dtype) for _ in range(3)),
    )
    return tuple(g.transpose(0, 3, 1, 2) for g in grads)  # [b, h, d, s] -> [b, s, h, d]


_flash.defvjp(_flash_fwd, _flash_bwd)
