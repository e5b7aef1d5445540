"""Paged attention: one query token per row attending to the row's cached pages in place.

A paged kernel is an `axplug.kernels` entry with `paged = True` (plugin API 1.3), best a
subclass of `PagedAttentionKernel`:

- `priority: int`, as the dense kernels;
- `is_supported(query, paged, backend) -> True | Unsupported(reason)`: query [b, h, d]
  (or a ShapeDtypeStruct), `paged` an `axplug.layers.PagedKV`;
- `__call__(query, paged, *, scale) -> [b, h, d]` in the pages' dtype: softmax attention of
  each row's query over the first `paged.lengths[b]` tokens of its pages, all visible (a
  decode step: the row's own new token is the last of them). Not differentiated;
- `supports_logit_softcap: bool` (optional) - True when `__call__` also takes
  `logit_softcap=cap` and soft-caps the scaled scores to `cap * tanh(s / cap)`; it is
  passed only when set, and only to kernels that declare it.

Dispatch (`select_paged_kernel`) tries them by priority and falls back to `XlaPagedKernel`;
dense dispatch never sees them. Accelerator kernels come from hardware plugins.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from axplug.api import Kernel, PagedKV, Unsupported
from axplug.kernels.dispatch import registered_kernels
from axplug.kernels.reference import soft_cap

__all__ = [
    "PagedAttentionKernel",
    "XlaPagedKernel",
    "check_paged_shapes",
    "paged_attention_xla",
    "select_paged_kernel",
]

PAGED_FALLBACK = "paged_xla"


def check_paged_shapes(query, paged: PagedKV) -> Unsupported | None:
    """None when `query` [b, h, d] and the pages fit together, else why not."""
    kvh, _, _, d = paged.key_pages.shape
    if query.ndim != 3:
        return Unsupported("query must be [batch, heads, head_dim] (one token per row)")
    if query.shape[1] % kvh:
        return Unsupported(f"{query.shape[1]} query heads not divisible by {kvh} kv heads")
    if query.shape[-1] != d:
        return Unsupported(f"query head_dim {query.shape[-1]} != the pages' {d}")
    if query.shape[0] != paged.block_table.shape[0]:
        return Unsupported("the block table has a row per query row")
    return None


def paged_attention_xla(
    query,
    paged: PagedKV,
    *,
    scale: float,
    pages_per_block: int = 8,
    logit_softcap: float | None = None,
):
    """Paged attention in plain JAX: a loop over blocks of `pages_per_block` pages of every
    row with an online softmax. Only the blocks that hold tokens are read (the loop runs to
    the longest row's), one block at a time: no row is gathered into a contiguous buffer. A
    pool whose table is in order (row r holds pages r*P.., or "no page" past its length, as a
    contiguous cache's and the Engine's unshared rows do) is read as a reshape instead, in one
    block. `logit_softcap` soft-caps the scaled scores (`cap * tanh(s / cap)`)."""
    key_pages, value_pages, table, lengths = paged
    kvh, num_pages, page, d = key_pages.shape
    b, h, _ = query.shape
    g = h // kvh
    block = min(pages_per_block, table.shape[1])
    blocks = math.ceil(table.shape[1] / block)
    width = blocks * block
    padded = jnp.pad(table, ((0, 0), (0, width - table.shape[1])), constant_values=num_pages)
    # [kvh, b, g, d]: kv heads and rows lead, as in the gathered pages, so the dots need no
    # transposed copy of keys or values.
    q = (query.astype(jnp.float32) * scale).reshape(b, kvh, g, d).transpose(1, 0, 2, 3)

    def attend(carry, k, v, index):  # online softmax over keys `k` at cache `index`
        m, total, acc = carry  # running max, softmax denominator, weighted values
        scores = soft_cap(jnp.einsum("kbgd,kbtd->kbgt", q, k), logit_softcap)
        valid = index[None, :] < lengths[:, None]  # [b, t]
        scores = jnp.where(valid[None, :, None, :], scores, -jnp.inf)
        m_new = jnp.maximum(m, scores.max(axis=-1))
        safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)  # rows with nothing yet
        alpha = jnp.exp(m - safe)
        p = jnp.exp(scores - safe[..., None])
        total = total * alpha + p.sum(axis=-1)
        acc = acc * alpha[..., None] + jnp.einsum("kbgt,kbtd->kbgd", p, v)
        return m_new, total, acc

    def body(i, carry):
        pages = jax.lax.dynamic_slice_in_dim(padded, i * block, block, axis=1)  # [b, block]

        def read(pool):  # [kvh, b, block * page, d]
            rows = jnp.take(pool, pages, axis=1, mode="fill", fill_value=0)
            return rows.reshape(kvh, b, block * page, d).astype(jnp.float32)

        index = i * block * page + jnp.arange(block * page)
        return attend(carry, read(key_pages), read(value_pages), index)

    def in_order(_):  # row r holds pages r*P..: its rows are a reshape of the pool, no gather
        k, v = (pool.reshape(kvh, b, -1, d).astype(jnp.float32) for pool in paged[:2])
        return attend(init, k, v, jnp.arange(k.shape[2]))

    init = (
        jnp.full((kvh, b, g), -jnp.inf, jnp.float32),
        jnp.zeros((kvh, b, g), jnp.float32),
        jnp.zeros((kvh, b, g, d), jnp.float32),
    )
    used = jnp.minimum(blocks, (jnp.max(lengths) + block * page - 1) // (block * page))
    gathered = functools.partial(jax.lax.fori_loop, 0, used, body)
    # A contiguous cache's table is always in order; XLA:CPU's gather costs 3x the attention.
    if num_pages == table.size:
        own = jnp.arange(table.size).reshape(table.shape)
        in_place = jnp.all((table == own) | (table == num_pages))  # or no page
        _, total, acc = jax.lax.cond(in_place, in_order, gathered, init)
    else:
        _, total, acc = gathered(init)
    out = acc / jnp.where(total > 0, total, 1.0)[..., None]
    return out.transpose(1, 0, 2, 3).reshape(b, h, d).astype(value_pages.dtype)


class PagedAttentionKernel(Kernel):
    """Base of paged-attention kernels: `is_supported` checks the shapes."""

    paged = True

    def is_supported(self, query, paged, backend):
        problem = check_paged_shapes(query, paged)
        return True if problem is None else problem


class XlaPagedKernel(PagedAttentionKernel):
    """Paged attention in plain JAX (`paged_attention_xla`): any backend, any sharding."""

    priority = 10
    pages_per_block = 8
    supports_logit_softcap = True

    def __call__(self, query, paged, *, scale, logit_softcap=None):
        return paged_attention_xla(
            query, paged, scale=scale, pages_per_block=self.pages_per_block,
            logit_softcap=logit_softcap,
        )  # fmt: skip


def paged_kernel_choices(
    query, paged, *, backend: str | None = None, logit_softcap: float | None = None
):
    """(name, kernel, answer) for every registered paged kernel in dispatch order, for a
    call whose scores are soft-capped by `logit_softcap` when it is set."""
    backend = backend or jax.default_backend()
    out = []
    for name, kernel in registered_kernels(paged=True):
        if logit_softcap is not None and not kernel.supports_logit_softcap:
            reason = "logit soft-capping (the kernel does not declare supports_logit_softcap)"
            out.append((name, kernel, Unsupported(reason)))
            continue
        try:
            answer = kernel.is_supported(query, paged, backend)
        except Exception as exc:  # noqa: BLE001 - a buggy check must not break dispatch
            answer = Unsupported(f"is_supported raised {type(exc).__name__}: {exc}")
        out.append((name, kernel, answer))
    return out


def select_paged_kernel(
    query, paged, *, backend: str | None = None, logit_softcap: float | None = None
):
    """(name, kernel): the first supported paged kernel by priority, else `XlaPagedKernel`;
    with `logit_softcap`, only kernels that declare `supports_logit_softcap`."""
    choices = paged_kernel_choices(query, paged, backend=backend, logit_softcap=logit_softcap)
    for name, kernel, answer in choices:
        if answer:
            return name, kernel
    return PAGED_FALLBACK, XlaPagedKernel()
