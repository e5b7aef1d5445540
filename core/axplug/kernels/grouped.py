"""Grouped matmul kernels: rows sorted by group, each group times its own matrix (MoE experts).

`grouped_matmul(lhs [m, k], rhs [groups, k, n], group_sizes [groups]) -> [m, n]`: rows
[sum(sizes[:g]), sum(sizes[:g+1])) of lhs times rhs[g]; rows past sum(group_sizes) are zeros.
Hardware plugins register kernels with `grouped_matmul = True` in `axplug.kernels` (a
Pallas/Mosaic grouped GEMM, say); dispatch asks each, by priority, whether it supports a
call and falls back to XLA's `jax.lax.ragged_dot`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from axplug.api import Kernel
from axplug.kernels.dispatch import registered_kernels

__all__ = [
    "GroupedMatmulKernel",
    "XlaGroupedMatmul",
    "grouped_matmul",
    "grouped_matmul_reference",
    "select_grouped_matmul",
]


class GroupedMatmulKernel(Kernel):
    """Base of grouped matmul kernels: `is_supported(lhs, rhs, group_sizes, backend)` (True
    or `Unsupported(reason)`) and `__call__(lhs, rhs, group_sizes)`, differentiable in lhs
    and rhs. `grouped_matmul = True` keeps attention dispatch from ever calling it."""

    grouped_matmul = True


class XlaGroupedMatmul(GroupedMatmulKernel):
    """`jax.lax.ragged_dot`: a grouped GEMM where XLA has one (GPU, TPU); XLA:CPU lowers it
    to a dense dot over every group (groups x the FLOPs)."""

    def __call__(self, lhs, rhs, group_sizes):
        return jax.lax.ragged_dot(lhs, rhs, group_sizes.astype(jnp.int32))


FALLBACK_GROUPED = XlaGroupedMatmul()


def grouped_matmul_reference(lhs, rhs, group_sizes) -> jax.Array:
    """The yardstick: each row times its group's matrix, by a one-hot sum over groups (groups
    x the FLOPs; for tests)."""
    ends = jnp.cumsum(group_sizes)
    row = jnp.arange(lhs.shape[0])
    group = jnp.searchsorted(ends, row, side="right")  # == groups past the last group
    onehot = jax.nn.one_hot(group, rhs.shape[0], dtype=lhs.dtype)  # [m, groups]
    return jnp.einsum("mk,gkn,mg->mn", lhs, rhs, onehot, preferred_element_type=jnp.float32)


def select_grouped_matmul(
    lhs, rhs, group_sizes, backend: str | None = None
) -> tuple[str, GroupedMatmulKernel]:
    """(name, kernel) of the first registered grouped matmul kernel, by priority, that
    supports this call on `backend` (default: jax's); else ("xla", the ragged dot)."""
    backend = backend or jax.default_backend()
    for name, kernel in registered_kernels(grouped=True):
        try:
            if kernel.is_supported(lhs, rhs, group_sizes, backend):
                return name, kernel
        except Exception:  # noqa: BLE001, S112 - a buggy check must not break dispatch
            continue
    return "xla", FALLBACK_GROUPED


def grouped_matmul(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array) -> jax.Array:
    """[m, n]: `lhs` rows grouped by `group_sizes` times their group's `rhs` matrix, by the
    dispatched kernel."""
    _, kernel = select_grouped_matmul(lhs, rhs, group_sizes)
    return kernel(lhs, rhs, group_sizes)
