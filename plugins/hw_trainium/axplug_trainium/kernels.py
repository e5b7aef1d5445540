"""The NKI flash attention of the Neuron compiler (`neuronxcc.nki.kernels.attention.flash_fwd`)
called from JAX through `jax_neuronx.nki_call`, when both are importable.

Forward runs the NKI kernel; the backward pass recomputes attention with the reference kernel
(correct gradients, forward-only acceleration). Masks are by index (see the GPU/TPU plugins),
so only whole-sequence self-attention is accepted. Not yet run on Trainium: see
tests/neuron_kernel_check.py.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from axplug_attention import AttentionKernel, ReferenceKernel, Unsupported
from axplug_attention.kernels import check_shapes

__all__ = ["NkiFlashKernel", "NEURON_BACKENDS"]

NEURON_BACKENDS = ("neuron",)

try:  # guarded: neither package exists off Trainium
    from jax_neuronx import nki_call as _nki_call
    from neuronxcc.nki.kernels.attention import FlashConfig as _FlashConfig
    from neuronxcc.nki.kernels.attention import flash_fwd as _flash_fwd
except Exception as exc:  # noqa: BLE001
    _nki_call = _flash_fwd = _FlashConfig = None
    _NKI_ERROR = f"jax-neuronx / neuronx-cc not importable ({type(exc).__name__}: {exc})"
else:
    _NKI_ERROR = None


class NkiFlashKernel(AttentionKernel):
    """NKI flash attention on NeuronCores: causal or full masks, bf16, seq a multiple of 512."""

    priority = 120
    tile = 512

    def availability(self, backend: str | None = None) -> str | None:
        """None when this kernel can run on `backend` (default: jax's), else why not."""
        if _NKI_ERROR is not None:
            return _NKI_ERROR
        backend = backend or jax.default_backend()
        return None if backend in NEURON_BACKENDS else f"needs Trainium; backend is {backend!r}"

    def is_supported(self, query, key, value, mask, backend):
        if _NKI_ERROR is not None:
            return Unsupported(_NKI_ERROR)
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
        return True

    def __call__(self, query, key, value, mask, *, scale):
        return _attention(query, key, value, mask, scale)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _attention(query, key, value, mask, scale):
    b, s, h, d = query.shape
    group = h // key.shape[2]
    k = jnp.repeat(key, group, axis=2) if group > 1 else key
    v = jnp.repeat(value, group, axis=2) if group > 1 else value
    # flash_fwd layouts: q, k [b, h, d, s]; v [b, h, s, d]; out [b, h, s, d].
    kernel = functools.partial(
        _flash_fwd,
        softmax_scale=scale,
        use_causal_mask=mask.causal,
        mixed_precision=True,
        dropout_p=0.0,
        config=_FlashConfig(seq_tile_size=min(s, 2048), training=False),
    )
    out = _nki_call(
        kernel,
        query.transpose(0, 2, 3, 1),
        k.transpose(0, 2, 3, 1),
        v.transpose(0, 2, 1, 3),
        jnp.zeros((1,), jnp.int32),  # dropout seed (unused: dropout_p=0)
        grid=(b, h),
        out_shape=jax.ShapeDtypeStruct((b, h, s, d), query.dtype),
    )
    return out.transpose(0, 2, 1, 3)


def _fwd(query, key, value, mask, scale):
    return _attention(query, key, value, mask, scale), (query, key, value)


def _bwd(mask, scale, residuals, grad):
    _, vjp = jax.vjp(lambda q, k, v: ReferenceKernel()(q, k, v, mask, scale=scale), *residuals)
    return vjp(grad)


_attention.defvjp(_fwd, _bwd)
