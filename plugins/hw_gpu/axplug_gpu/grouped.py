"""Mosaic GPU's grouped matmul (`jax.experimental.pallas.ops.gpu.ragged_dot_mgpu`) as an
axplug kernel, the GPU twin of axplug-tpu's megablox.

A Hopper (sm90) warp-specialised grouped GEMM: each group's rows against its matrix in
(128, 128, 64) tiles. Its VJP runs the same kernel on the transposed weights for the rows'
gradient and the transposed form (`transposed_ragged_dot_mgpu`, groups along the contraction)
for the weights'. XLA cannot partition a Mosaic call, so a call under a multi-device sharding
scope is declined and dispatch falls back to XLA's ragged dot.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from axplug.api import Unsupported
from axplug.api.kernels import GroupedMatmulKernel
from axplug.api.sharding import current_scope
from axplug_gpu.kernels import GPU_BACKENDS, _compute_capability, _gpu_availability

__all__ = ["MosaicGpuGroupedMatmul"]

_MGPU_ERROR: str | None
try:  # guarded: the plugin imports on any jaxlib
    from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu as _ragged
    from jax.experimental.pallas.ops.gpu import transposed_ragged_dot_mgpu as _transposed
except Exception as exc:  # noqa: BLE001
    _ragged = _transposed = None  # type: ignore[assignment]
    _MGPU_ERROR = f"{type(exc).__name__}: {exc}"
else:
    _MGPU_ERROR = None


def _tiled(kernel):
    """A Hopper ragged-dot `kernel` at fixed tiles (its autotuner's range holds these for
    128-wide operands)."""
    return functools.partial(kernel, block_m=128, block_n=128, block_k=64,
                             max_concurrent_steps=2, grid_block_n=1)  # fmt: skip


class MosaicGpuGroupedMatmul(GroupedMatmulKernel):
    """Mosaic GPU grouped GEMM on Hopper: bfloat16 or float16, the contraction and output
    widths multiples of 128, one device's call."""

    priority = 100
    dtypes = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))

    def availability(self, backend: str | None = None) -> str | None:
        """None when this kernel can run on `backend` (default: jax's), else why not."""
        if _ragged is None:
            return f"ragged_dot_mgpu not importable: {_MGPU_ERROR}"
        if (why := _gpu_availability(backend)) is not None:
            return why
        cc = _compute_capability()
        return None if cc is None or cc >= 9.0 else f"compute capability {cc} (needs 9.0)"

    def is_supported(self, lhs, rhs, group_sizes, backend):
        if _ragged is None:
            return Unsupported(f"ragged_dot_mgpu not importable: {_MGPU_ERROR}")
        if backend not in GPU_BACKENDS:
            return Unsupported(f"needs a CUDA GPU backend, not {backend!r}")
        if lhs.dtype != rhs.dtype or lhs.dtype not in self.dtypes:
            return Unsupported(f"dtypes {lhs.dtype} x {rhs.dtype} (needs bfloat16/float16)")
        k, n = lhs.shape[1], rhs.shape[-1]
        if k % 128 or n % 128:
            return Unsupported(f"[{k}] x [{n}] widths (Mosaic GPU needs multiples of 128)")
        cc = _compute_capability()
        if cc is not None and cc < 9.0:
            return Unsupported(f"compute capability {cc} (the kernel needs 9.0, Hopper)")
        scope = current_scope()
        if scope is not None and scope.mesh.size > 1:
            return Unsupported(
                "a call under a multi-device mesh (Mosaic calls are not partitioned)"
            )
        return True

    def __call__(self, lhs, rhs, group_sizes):
        out = _grouped(lhs, rhs, group_sizes.astype(jnp.int32))
        rows = jnp.arange(lhs.shape[0])[:, None] < jnp.sum(group_sizes)
        return jnp.where(rows, out, 0).astype(lhs.dtype)  # the contract: zeros past the groups


@jax.custom_vjp
def _grouped(lhs, rhs, group_sizes):
    return _tiled(_ragged.ragged_dot)(lhs, rhs, group_sizes=group_sizes)


def _grouped_fwd(lhs, rhs, group_sizes):
    return _grouped(lhs, rhs, group_sizes), (lhs, rhs, group_sizes)


def _grouped_bwd(residuals, d_out):
    lhs, rhs, group_sizes = residuals
    d_out = d_out.astype(lhs.dtype)
    # [m, n] x [g, k, n]^T
    d_lhs = _tiled(_ragged.ragged_dot)(d_out, rhs, group_sizes=group_sizes, transpose_rhs=True)
    # Groups along the contraction (the rows): [m, k]^T x [m, n] -> [g, k, n].
    d_rhs = _tiled(_transposed.transposed_ragged_dot)(lhs, d_out, group_sizes=group_sizes)
    return d_lhs.astype(lhs.dtype), d_rhs.astype(rhs.dtype), _no_gradient(group_sizes)


def _no_gradient(x):
    return np.zeros(x.shape, jax.dtypes.float0)


_grouped.defvjp(_grouped_fwd, _grouped_bwd)
