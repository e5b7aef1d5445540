"""Paged attention on GPU: the Pallas (Triton) kernel of `jax.experimental.pallas.ops.gpu`.

It reads each row's pages straight from the head-major pool axplug's `PagedKVCache` keeps
([kv_heads, pages, page, head_dim]), splitting the pages over `k_splits` programs. A Pallas
call cannot be partitioned by XLA, so under a multi-device sharding scope it declines and
dispatch falls back to the XLA paged kernel.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from axplug.api import Unsupported
from axplug.api.kernels import PagedAttentionKernel, check_paged_shapes
from axplug.api.sharding import current_scope

__all__ = ["PallasGpuPagedKernel"]

_PAGED_ERROR: str | None
try:  # guarded: a jaxlib without Pallas GPU support must not break the plugin
    from jax.experimental.pallas.ops.gpu import paged_attention as _paged
except Exception as exc:  # noqa: BLE001
    _paged, _PAGED_ERROR = None, f"{type(exc).__name__}: {exc}"  # type: ignore[assignment]
else:
    _PAGED_ERROR = None


def _largest_divisor(n: int, limit: int) -> int:
    return max(d for d in range(1, min(n, limit) + 1) if n % d == 0)


def one_device_scope() -> Unsupported | None:
    """None unless a sharding scope spans several devices (a Pallas call is opaque to XLA)."""
    scope = current_scope()
    if scope is not None and scope.mesh.size > 1:
        return Unsupported(f"a {scope.mesh.size}-device mesh (the XLA paged kernel shards)")
    return None


class PallasGpuPagedKernel(PagedAttentionKernel):
    """The Pallas GPU paged-attention kernel (decode steps of a paged KV cache)."""

    priority = 110
    dtypes = (jnp.dtype(jnp.float16), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32))
    # True runs the Pallas interpreter (any backend, slow): how the CPU tests check numerics.
    interpret = False

    def availability(self, backend: str | None = None) -> str | None:
        """None when this kernel can run on `backend` (default: jax's), else why not."""
        if _paged is None:
            return f"Pallas GPU paged attention not importable: {_PAGED_ERROR}"
        backend = backend or jax.default_backend()
        return None if backend in ("gpu", "cuda") else f"needs a CUDA GPU, not {backend!r}"

    def is_supported(self, query, paged, backend):
        if _paged is None:
            return Unsupported(f"Pallas GPU paged attention not importable: {_PAGED_ERROR}")
        if backend not in ("gpu", "cuda"):
            return Unsupported(f"needs a CUDA GPU backend, not {backend!r}")
        if (problem := check_paged_shapes(query, paged)) is not None:
            return problem
        if paged.key_pages.dtype not in self.dtypes:
            return Unsupported(f"dtype {paged.key_pages.dtype} (needs float16/bfloat16/float32)")
        if paged.key_pages.shape[-1] % 16:
            return Unsupported(f"head_dim {paged.key_pages.shape[-1]} not a multiple of 16")
        problem = one_device_scope()
        return True if problem is None else problem

    def __call__(self, query, paged, *, scale):
        key_pages, value_pages, table, lengths = paged
        pages_per_row = table.shape[1]
        splits = _largest_divisor(pages_per_row, 16)
        per_block = _largest_divisor(pages_per_row // splits, 8)
        # The kernel takes unscaled logits and in-range pages ("no page" entries lie past
        # every row's length, so clamping them reads nothing that counts).
        q = (query.astype(jnp.float32) * scale).astype(key_pages.dtype)
        table = jnp.minimum(table, key_pages.shape[1] - 1)
        out = _paged.paged_attention(
            q, key_pages, value_pages, table, lengths.astype(jnp.int32),
            k_splits=splits, pages_per_compute_block=per_block, interpret=self.interpret,
        )  # fmt: skip
        return out.astype(value_pages.dtype)
