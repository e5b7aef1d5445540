"""GPU attention kernels: cuDNN flash attention and the Pallas (Triton) flash kernel.

Both compute attention by *index*: causal means key index <= query index. That equals the
position-based mask of `AttentionMask` for self-attention over a whole sequence (training,
prefill), where positions increase with the index; decoding (q_len != kv_len) is left to the
XLA kernel. Packed sequences are handled through segment ids. Under a multi-device sharding
scope each call runs per device on its batch rows (and heads) in a shard_map
(`axplug.kernels.shard_over_batch`); a sequence sharded over the `seq` mesh axis is declined, so
dispatch falls back to the XLA kernel, which is exact there.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from axplug.api import AttentionKernel, Unsupported, check_shapes
from axplug.api.kernels import check_sequence_sharding, shard_over_batch

__all__ = ["CudnnFlashKernel", "PallasGpuFlashKernel", "GPU_BACKENDS"]

GPU_BACKENDS = ("gpu", "cuda")

_PALLAS_ERROR: str | None
try:  # guarded: a jaxlib without Pallas GPU support must not break the plugin
    from jax.experimental.pallas.ops.gpu import attention as _pallas_attention
except Exception as exc:  # noqa: BLE001
    _pallas_attention, _PALLAS_ERROR = None, f"{type(exc).__name__}: {exc}"  # type: ignore[assignment]
else:
    _PALLAS_ERROR = None


def _common(query, key, value, mask, backend: str, dtypes) -> Unsupported | None:
    """Checks both kernels share: backend, shapes, dtypes, self-attention, sharding."""
    if backend not in GPU_BACKENDS:
        return Unsupported(f"needs a CUDA GPU backend, not {backend!r}")
    if (problem := check_shapes(query, key, value)) is not None:
        return problem
    if not query.dtype == key.dtype == value.dtype:
        return Unsupported("q, k, v dtypes differ")
    if query.dtype not in dtypes:
        names = "/".join(jnp.dtype(d).name for d in dtypes)
        return Unsupported(f"dtype {query.dtype} (needs {names})")
    if query.shape[1] != key.shape[1]:
        return Unsupported("q_len != kv_len (decoding): index-based masks would be wrong")
    if getattr(mask, "logit_softcap", None) is not None:
        return Unsupported("logit soft-capping (not passed to the GPU kernels)")
    return check_sequence_sharding(query)


def _gpu_availability(backend: str | None) -> str | None:
    backend = backend or jax.default_backend()
    if backend not in GPU_BACKENDS:
        return f"needs a CUDA GPU backend; this machine's is {backend!r}"
    return None


def _compute_capability() -> float | None:
    """The local GPU's compute capability when jax runs on one, else None (simulated)."""
    if jax.default_backend() not in GPU_BACKENDS:
        return None
    try:
        return float(jax.devices()[0].compute_capability)
    except (AttributeError, ValueError):
        return None


class CudnnFlashKernel(AttentionKernel):
    """`jax.nn.dot_product_attention(implementation="cudnn")`: cuDNN fused flash attention."""

    priority = 120
    dtypes = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
    supports_linear_bias = True  # passed to cuDNN as a 4-D bias

    def availability(self, backend: str | None = None) -> str | None:
        """None when this kernel can run on `backend` (default: jax's), else why not."""
        return _gpu_availability(backend)

    def is_supported(self, query, key, value, mask, backend):
        if (problem := _common(query, key, value, mask, backend, self.dtypes)) is not None:
            return problem
        d = query.shape[-1]
        if d > 128 or d % 8:
            return Unsupported(f"head_dim {d} (cuDNN flash needs a multiple of 8, <= 128)")
        if mask.q_segment_ids is not None:
            return Unsupported("segment ids (packed sequences) are not passed to cuDNN")
        if mask.sliding_window is not None and not mask.causal:
            return Unsupported("a non-causal sliding window")
        if mask.linear_bias_slopes is not None and mask.sliding_window is not None:
            return Unsupported("a score bias with a sliding window")
        cc = _compute_capability()
        if cc is not None and cc < 8.0:
            return Unsupported(f"compute capability {cc} (cuDNN flash needs >= 8.0, Ampere)")
        return True

    def __call__(self, query, key, value, mask, *, scale):
        return shard_over_batch(self.attend, query, key, value, mask, scale=scale)

    def attend(self, query, key, value, mask, *, scale):
        """The cuDNN call on one device's operands (what `__call__` runs per shard)."""
        window = None if mask.sliding_window is None else (mask.sliding_window - 1, 0)
        return jax.nn.dot_product_attention(
            query,
            key,
            value,
            bias=mask.bias(),  # the ALiBi bias from positions (a 4-D bias cuDNN adds)
            scale=scale,
            is_causal=mask.causal,
            local_window_size=window,
            implementation="cudnn",
        )


class PallasGpuFlashKernel(AttentionKernel):
    """The Pallas (Triton) flash attention of `jax.experimental.pallas.ops.gpu.attention`:
    covers what cuDNN does not (float32, packed sequences), without GQA or windows."""

    priority = 110
    dtypes = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32))
    block = 128
    # True runs the Pallas interpreter (any backend, slow): how the CPU tests check numerics.
    interpret = False

    def availability(self, backend: str | None = None) -> str | None:
        """None when this kernel can run on `backend` (default: jax's), else why not."""
        if _pallas_attention is None:
            return f"Pallas GPU attention not importable: {_PALLAS_ERROR}"
        return _gpu_availability(backend)

    def is_supported(self, query, key, value, mask, backend):
        if _pallas_attention is None:
            return Unsupported(f"Pallas GPU attention not importable: {_PALLAS_ERROR}")
        if (problem := _common(query, key, value, mask, backend, self.dtypes)) is not None:
            return problem
        if query.shape[2] != key.shape[2]:
            return Unsupported("grouped kv heads (the Pallas GPU kernel needs MHA)")
        d, s = query.shape[-1], query.shape[1]
        if d < 16 or d & (d - 1):
            return Unsupported(f"head_dim {d} (needs a power of two >= 16)")
        if s % self.block:
            return Unsupported(f"seq {s} not a multiple of the {self.block} block")
        if mask.sliding_window is not None:
            return Unsupported("sliding window")
        if mask.q_segment_ids is not mask.kv_segment_ids:
            return Unsupported("different q and kv segment ids")
        if mask.linear_bias_slopes is not None:
            return Unsupported("a score bias (the Pallas GPU kernel takes none)")
        return True

    def __call__(self, query, key, value, mask, *, scale):
        return shard_over_batch(self.attend, query, key, value, mask, scale=scale)

    def attend(self, query, key, value, mask, *, scale):
        """The Triton call on one device's operands (what `__call__` runs per shard)."""
        return _pallas_attention.mha(
            query,
            key,
            value,
            mask.q_segment_ids,
            sm_scale=scale,
            causal=mask.causal,
            interpret=self.interpret,
        )
