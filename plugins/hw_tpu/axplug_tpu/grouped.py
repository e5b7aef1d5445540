"""Megablox's grouped matmul (`jax.experimental.pallas.ops.tpu.megablox`) as an axplug kernel.

A Pallas/Mosaic grouped GEMM for TPU: each group's rows run against its matrix in
(128, 128, 128) tiles, and its custom VJP computes the gradients with the same kernel and its
transposed form (`tgmm`). XLA cannot partition a Mosaic call, so a call under a multi-device
sharding scope is declined and dispatch falls back to XLA's ragged dot.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from axplug.api import Unsupported
from axplug.api.kernels import GroupedMatmulKernel
from axplug.api.sharding import current_scope

__all__ = ["MegabloxGroupedMatmul"]

_MEGABLOX_ERROR: str | None
try:  # guarded: the plugin imports on any jaxlib
    from jax.experimental.pallas.ops.tpu.megablox import ops as _megablox
except Exception as exc:  # noqa: BLE001
    _megablox, _MEGABLOX_ERROR = None, f"{type(exc).__name__}: {exc}"  # type: ignore[assignment]
else:
    _MEGABLOX_ERROR = None


class MegabloxGroupedMatmul(GroupedMatmulKernel):
    """Megablox GMM on TPU: float32 or bfloat16, k and n multiples of the 128 tile, rows a
    multiple of the row tile (`tile`), one device's call."""

    priority = 100
    tile = (128, 128, 128)  # rows, contraction, output
    dtypes = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32))
    # True runs the Pallas interpreter (any backend, slow): how the CPU tests check numerics.
    interpret = False

    def availability(self, backend: str | None = None) -> str | None:
        """None when this kernel can run on `backend` (default: jax's), else why not."""
        if _megablox is None:
            return f"megablox not importable: {_MEGABLOX_ERROR}"
        backend = backend or jax.default_backend()
        return None if backend == "tpu" else f"needs a TPU; this machine's backend is {backend!r}"

    def is_supported(self, lhs, rhs, group_sizes, backend):
        if _megablox is None:
            return Unsupported(f"megablox not importable: {_MEGABLOX_ERROR}")
        if backend != "tpu":
            return Unsupported(f"needs the TPU backend, not {backend!r}")
        if lhs.dtype != rhs.dtype or lhs.dtype not in self.dtypes:
            return Unsupported(f"dtypes {lhs.dtype} x {rhs.dtype} (needs bfloat16/float32)")
        (m, k), n = lhs.shape, rhs.shape[-1]
        tm, tk, tn = self.tile
        if m % tm or k % tk or n % tn:
            return Unsupported(
                f"shape [{m}, {k}] x [{k}, {n}] not a multiple of the {self.tile} tiles"
            )
        scope = current_scope()
        if scope is not None and scope.mesh.size > 1:
            return Unsupported(
                "a call under a multi-device mesh (Mosaic calls are not partitioned)"
            )
        return True

    def __call__(self, lhs, rhs, group_sizes):
        out = _megablox.gmm(
            lhs,
            rhs,
            group_sizes.astype(jnp.int32),
            jnp.float32,
            self.tile,
            None,
            None,
            False,
            self.interpret,
        )
        # Megablox leaves rows past the last group unwritten; the contract says zeros.
        rows = jnp.arange(lhs.shape[0])[:, None] < jnp.sum(group_sizes)
        return jnp.where(rows, out, 0).astype(lhs.dtype)
