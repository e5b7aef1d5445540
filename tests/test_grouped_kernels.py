"""Grouped matmul dispatch (`axplug.kernels.grouped`): the XLA fallback passes the
conformance kit, attention dispatch never sees a grouped kernel, and dispatch picks a
registered kernel only where it says it runs."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from axplug_testing import GroupedMatmulConformance, group_size_cases

from axplug.api import Unsupported
from axplug.kernels import (
    GroupedMatmulKernel,
    XlaGroupedMatmul,
    grouped_matmul,
    grouped_matmul_reference,
    registered_kernels,
    select_grouped_matmul,
)


class TestXlaGroupedMatmul(GroupedMatmulConformance):
    @pytest.fixture
    def kernel(self):
        return XlaGroupedMatmul()


def test_the_reference_is_a_per_row_loop():
    lhs = jnp.arange(12.0).reshape(6, 2)
    rhs = jnp.stack([jnp.eye(2), 2 * jnp.eye(2), 3 * jnp.eye(2)])
    sizes = jnp.array([2, 0, 3])  # row 5 is in no group
    want = jnp.concatenate([lhs[:2], 3 * lhs[2:5], jnp.zeros((1, 2))])
    assert jnp.array_equal(grouped_matmul_reference(lhs, rhs, sizes), want)
    assert group_size_cases(64, 4)["uneven"] == [32, 0, 16, 16]


def test_attention_dispatch_never_lists_grouped_kernels():
    attention = {name for name, _ in registered_kernels()}
    grouped = {name for name, _ in registered_kernels(grouped=True)}
    assert not attention & grouped
    assert all(getattr(k, "grouped_matmul", False) for _, k in registered_kernels(grouped=True))


class _Picky(GroupedMatmulKernel):
    priority = 50

    def is_supported(self, lhs, rhs, group_sizes, backend):
        return True if backend == "tpu" else Unsupported("needs the TPU backend")

    def __call__(self, lhs, rhs, group_sizes):
        return grouped_matmul_reference(lhs, rhs, group_sizes).astype(lhs.dtype)


class _Broken(GroupedMatmulKernel):
    priority = 90

    def is_supported(self, lhs, rhs, group_sizes, backend):
        raise RuntimeError("a bug in the check")


def test_dispatch_takes_the_first_kernel_that_supports_the_call(monkeypatch):
    import axplug.kernels.grouped as grouped

    kernels = [("broken", _Broken()), ("picky", _Picky())]
    monkeypatch.setattr(grouped, "registered_kernels", lambda grouped: kernels)
    lhs, rhs, sizes = jnp.ones((4, 2)), jnp.ones((2, 2, 3)), jnp.array([1, 3])
    assert select_grouped_matmul(lhs, rhs, sizes, "tpu")[0] == "picky"
    assert select_grouped_matmul(lhs, rhs, sizes, "cpu")[0] == "xla"
    assert jnp.allclose(grouped_matmul(lhs, rhs, sizes), jax.lax.ragged_dot(lhs, rhs, sizes))
