"""Conformance checks for grouped matmul kernels (`grouped_matmul = True` entries of
axplug.kernels)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from axplug.kernels.grouped import grouped_matmul_reference
from axplug_testing._kernel import NumericsFixtures, declared_kernel, skip_unless_supported

__all__ = ["GroupedMatmulConformance", "group_size_cases"]


def group_size_cases(m: int, groups: int) -> dict[str, list[int]]:
    """Group sizes over m rows: uneven with an empty group, every row in one group, and
    rows left past the last group (which must come out zero)."""
    uneven = [m // 2, 0, m // 4] + [0] * (groups - 3)
    uneven[-1] += m - sum(uneven)
    one = [0] * groups
    one[groups // 2] = m
    short = [m // (2 * groups)] * groups  # half the rows in no group
    return {"uneven": uneven, "one_group": one, "rows_past_the_groups": short}


# The checks' yardstick, compiled: one program per problem shape, not one per op.
_compiled_reference = jax.jit(grouped_matmul_reference)


class GroupedMatmulConformance(NumericsFixtures):
    """Subclass as `TestMyGmm(GroupedMatmulConformance)` and override `kernel`.

    `kernel` returns an object with `grouped_matmul = True`, `__call__(lhs, rhs,
    group_sizes)` and `is_supported(lhs, rhs, group_sizes, backend)` (see
    `axplug.kernels.grouped`). Optional fixtures: `backend` (jax's; a kernel checked in an
    interpreter on another backend names its own), `problem_shapes` ((m, k, n, groups): a
    kernel with tile limits sets its own), `dtype`, `tolerance`.
    """

    float32_tolerance = 1e-4  # blocked accumulation against one einsum

    @pytest.fixture
    def kernel(self):
        raise NotImplementedError(
            f"{type(self).__name__}: override the `kernel` fixture to return your kernel"
        )

    @pytest.fixture
    def backend(self) -> str:
        return jax.default_backend()

    @pytest.fixture
    def problem_shapes(self) -> tuple[int, int, int, int]:
        return 64, 16, 24, 4

    def _problem(self, problem_shapes, dtype, sizes):
        m, k, n, groups = problem_shapes
        rng = np.random.default_rng(0)
        lhs = jnp.asarray(rng.normal(size=(m, k)), dtype)
        rhs = jnp.asarray(rng.normal(size=(groups, k, n)) / np.sqrt(k), dtype)
        return lhs, rhs, jnp.asarray(sizes, jnp.int32)

    def test_declares_itself_a_grouped_matmul(self, kernel):
        assert declared_kernel(kernel).grouped_matmul is True, (
            "a grouped matmul kernel sets `grouped_matmul = True`; without it attention "
            "dispatch would call it with (query, key, value, mask)"
        )

    @pytest.mark.parametrize("case", ["uneven", "one_group", "rows_past_the_groups"])
    def test_matches_the_reference(self, kernel, backend, problem_shapes, dtype, tolerance, case):
        m, _, n, groups = problem_shapes
        args = self._problem(problem_shapes, dtype, group_size_cases(m, groups)[case])
        skip_unless_supported(kernel, *args, backend)
        got = kernel(*args)
        assert got.shape == (m, n) and got.dtype == dtype
        want = _compiled_reference(*args)
        np.testing.assert_allclose(
            np.asarray(got, np.float32), np.asarray(want, np.float32), **tolerance
        )

    def test_gradients_match_the_reference(self, kernel, backend, problem_shapes, dtype, tolerance):
        m, _, _, groups = problem_shapes
        args = self._problem(problem_shapes, dtype, group_size_cases(m, groups)["uneven"])
        skip_unless_supported(kernel, *args, backend)
        probe = jnp.asarray(np.random.default_rng(1).normal(size=(m, problem_shapes[2])), dtype)

        def loss(fn):
            return lambda lhs, rhs: jnp.sum(fn(lhs, rhs, args[2]).astype(jnp.float32) * probe)

        # Compiled, as a train step takes them: op by op, each op would compile on its own.
        got = jax.jit(jax.grad(loss(kernel), argnums=(0, 1)))(*args[:2])
        want = jax.jit(jax.grad(loss(grouped_matmul_reference), argnums=(0, 1)))(*args[:2])
        for a, b in zip(got, want, strict=True):
            np.testing.assert_allclose(
                np.asarray(a, np.float32), np.asarray(b, np.float32), **tolerance
            )
