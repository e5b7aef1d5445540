"""Paged attention on TPU: the Pallas (Mosaic) kernel of `jax.experimental.pallas.ops.tpu`.

It reads each row's pages straight from the head-major pool axplug's `PagedKVCache` keeps
([kv_heads, pages, page, head_dim]) into VMEM, a block of pages at a time. A Mosaic call
cannot be partitioned by XLA, so under a multi-device sharding scope it declines and
dispatch falls back to the XLA paged kernel.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from axplug.api import Unsupported
from axplug.api.kernels import PagedAttentionKernel, check_paged_shapes
from axplug.api.sharding import current_scope

__all__ = ["PallasTpuPagedKernel"]

_PAGED_ERROR: str | None
try:  # guarded: the plugin imports on any jaxlib
    from jax.experimental.pallas.ops.tpu.paged_attention import paged_attention as _paged
except Exception as exc:  # noqa: BLE001
    _paged, _PAGED_ERROR = None, f"{type(exc).__name__}: {exc}"  # type: ignore[assignment]
else:
    _PAGED_ERROR = None


class PallasTpuPagedKernel(PagedAttentionKernel):
    """The Pallas TPU paged-attention kernel (decode steps of a paged KV cache)."""

    priority = 120
    dtypes = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32))

    def availability(self, backend: str | None = None) -> str | None:
        """None when this kernel can run on `backend` (default: jax's), else why not."""
        if _paged is None:
            return f"Pallas TPU paged attention not importable: {_PAGED_ERROR}"
        backend = backend or jax.default_backend()
        return None if backend == "tpu" else f"needs a TPU; this machine's backend is {backend!r}"

    def is_supported(self, query, paged, backend):
        if _paged is None:
            return Unsupported(f"Pallas TPU paged attention not importable: {_PAGED_ERROR}")
        if backend != "tpu":
            return Unsupported(f"needs the TPU backend, not {backend!r}")
        if (problem := check_paged_shapes(query, paged)) is not None:
            return problem
        if paged.key_pages.dtype not in self.dtypes:
            return Unsupported(f"dtype {paged.key_pages.dtype} (needs bfloat16/float32)")
        _, _, page, d = paged.key_pages.shape
        if d % 128:
            return Unsupported(f"head_dim {d} not a multiple of 128 (TPU lane width)")
        if page % 8:
            return Unsupported(f"page_size {page} not a multiple of 8 (TPU sublanes)")
        scope = current_scope()
        if scope is not None and scope.mesh.size > 1:
            return Unsupported(f"a {scope.mesh.size}-device mesh (the XLA paged kernel shards)")
        return True

    def __call__(self, query, paged, *, scale):
        key_pages, value_pages, table, lengths = paged
        pages_per_row = table.shape[1]
        per_block = max(d for d in range(1, min(pages_per_row, 8) + 1) if pages_per_row % d == 0)
        q = (query.astype(jnp.float32) * scale).astype(key_pages.dtype)
        table = jnp.minimum(table, key_pages.shape[1] - 1)  # "no page" lies past the length
        out = _paged(
            q, key_pages, value_pages, lengths.astype(jnp.int32), table,
            pages_per_compute_block=per_block,
        )  # fmt: skip
        return out.astype(value_pages.dtype)
