"""Conformance checks for paged-attention kernels (`paged = True` entries of axplug.kernels)."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from axplug.api import PagedKV
from axplug.kernels.reference import reference_attention
from axplug_testing._kernel import NumericsFixtures, declared_kernel, skip_unless_supported

__all__ = ["PagedKernelConformance", "make_paged_problem", "paged_reference"]


def make_paged_problem(
    *, kv_heads=2, heads=4, head_dim=16, page=4, pages_per_row=5, dtype=jnp.float32, seed=0
) -> tuple[jax.Array, PagedKV]:
    """(query [4, heads, d], PagedKV): random pools, each row's pages scattered over the pool
    in no order, lengths from one token to a full row, "no page" entries past each length."""
    rng = np.random.default_rng(seed)
    b = 4
    num_pages = b * pages_per_row + 3
    shape = (kv_heads, num_pages, page, head_dim)
    key_pages, value_pages = (rng.normal(size=shape).astype(np.float32) for _ in range(2))
    table = rng.permutation(num_pages)[: b * pages_per_row].reshape(b, pages_per_row)
    lengths = np.array([1, page + 1, 2 * page, pages_per_row * page], np.int32)
    for row, length in enumerate(lengths):
        table[row, -(-length // page) :] = num_pages
    query = rng.normal(size=(b, heads, head_dim)).astype(np.float32)
    cast = lambda a: jnp.asarray(a, dtype)  # noqa: E731
    paged = PagedKV(cast(key_pages), cast(value_pages), jnp.asarray(table, jnp.int32),
                    jnp.asarray(lengths))  # fmt: skip
    return cast(query), paged


def paged_reference(
    query, paged: PagedKV, *, scale: float, logit_softcap: float | None = None
) -> jax.Array:
    """Each row's pages gathered into a contiguous row, then the core's reference attention
    over its first `lengths[b]` tokens (scores soft-capped by `logit_softcap` when set): the
    yardstick for paged kernels."""
    key_pages, value_pages, table, lengths = paged
    kvh, num_pages, page, d = key_pages.shape

    def rows(pool):  # [b, pages_per_row * page, kvh, d]
        gathered = jnp.take(pool, table, axis=1, mode="fill", fill_value=0)
        return jnp.moveaxis(gathered.reshape(kvh, table.shape[0], -1, d), 0, 2)

    k, v = rows(key_pages), rows(value_pages)
    visible = jnp.arange(k.shape[1])[None, :] < lengths[:, None]  # [b, t]
    out = reference_attention(
        query[:, None], k, v, visible[:, None, None, :], scale=scale, logit_softcap=logit_softcap
    )
    return out[:, 0]


# The checks' yardstick, compiled: one program per problem shape, not one per op.
_compiled_reference = jax.jit(paged_reference, static_argnames=("scale", "logit_softcap"))


class PagedKernelConformance(NumericsFixtures):
    """Subclass as `TestMyPagedKernel(PagedKernelConformance)` and override `kernel`.

    `kernel` returns an object with `paged = True`, `__call__(query, paged, *, scale)` and
    optionally `is_supported(query, paged, backend)` (see `axplug.kernels.paged`). Optional
    fixtures: `dtype` (float32), `tolerance`, `problem_shapes` (keyword arguments of
    `make_paged_problem`: a kernel with layout limits, such as a 128-wide head_dim on TPU,
    sets its own). A kernel with `supports_logit_softcap = True` is checked with a cap too.
    """

    float32_tolerance = 1e-4  # blocked online softmax against one softmax

    @pytest.fixture
    def kernel(self):
        raise NotImplementedError(
            f"{type(self).__name__}: override the `kernel` fixture to return your kernel"
        )

    @pytest.fixture
    def problem_shapes(self) -> dict:
        return {}

    def test_declares_itself_paged(self, kernel):
        assert declared_kernel(kernel).paged is True, (
            "a paged kernel sets `paged = True`; without it dense dispatch would call it with "
            "(query, key, value, mask)"
        )

    @pytest.mark.parametrize("grouping", ["gqa", "mha"])
    def test_matches_attention_over_the_gathered_rows(
        self, kernel, dtype, tolerance, problem_shapes, grouping
    ):
        shapes = {"kv_heads": 2, "heads": 4 if grouping == "gqa" else 2, **problem_shapes}
        query, paged = make_paged_problem(dtype=dtype, **shapes)
        skip_unless_supported(kernel, query, paged, jax.default_backend())
        scale = 1.0 / math.sqrt(query.shape[-1])
        got = kernel(query, paged, scale=scale)
        assert got.shape == query.shape and got.dtype == paged.value_pages.dtype
        want = _compiled_reference(query, paged, scale=scale)
        np.testing.assert_allclose(
            np.asarray(got, np.float32), np.asarray(want, np.float32), **tolerance
        )

    def test_logit_softcap(self, kernel, dtype, tolerance, problem_shapes):
        if not declared_kernel(kernel).supports_logit_softcap:
            pytest.skip("the kernel does not declare supports_logit_softcap")
        query, paged = make_paged_problem(dtype=dtype, **problem_shapes)
        skip_unless_supported(kernel, query, paged, jax.default_backend())
        scale, cap = 1.0 / math.sqrt(query.shape[-1]), 0.5  # a cap that bends the scores
        got = kernel(query, paged, scale=scale, logit_softcap=cap)
        want = _compiled_reference(query, paged, scale=scale, logit_softcap=cap)
        uncapped = _compiled_reference(query, paged, scale=scale)
        assert not np.allclose(np.asarray(want), np.asarray(uncapped), **tolerance)
        np.testing.assert_allclose(
            np.asarray(got, np.float32), np.asarray(want, np.float32), **tolerance
        )

    def test_reads_only_the_pages_its_table_names(self, kernel, dtype, problem_shapes):
        query, paged = make_paged_problem(dtype=dtype, **problem_shapes)
        skip_unless_supported(kernel, query, paged, jax.default_backend())
        # NaN in every page no row's table names: a kernel that let one into its sums
        # (masked scores still multiply values: 0 * NaN is NaN) returns NaN.
        values = np.asarray(paged.value_pages, np.float32).copy()
        named = set(np.asarray(paged.block_table).ravel().tolist())
        for p in range(values.shape[1]):
            if p not in named:
                values[:, p] = np.nan
        poisoned = paged._replace(value_pages=jnp.asarray(values, paged.value_pages.dtype))
        got = kernel(query, poisoned, scale=0.25)
        want = _compiled_reference(query, paged, scale=0.25)
        assert np.isfinite(np.asarray(got, np.float32)).all()
        np.testing.assert_allclose(
            np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=2e-2, atol=2e-2
        )
