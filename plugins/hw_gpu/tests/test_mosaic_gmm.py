"""Mosaic GPU's grouped matmul as an axplug kernel: its gate and the real dispatch choosing it
for a GPU call, on CPU; its numerics through the conformance kit on a Hopper GPU (`-m gpu`,
bench/gpu_session.sh)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

axplug_gpu = pytest.importorskip("axplug_gpu")

from axplug_gpu.grouped import MosaicGpuGroupedMatmul  # noqa: E402
from axplug_testing import GroupedMatmulConformance  # noqa: E402

from axplug.api.kernels import select_grouped_matmul  # noqa: E402

BF16 = jnp.bfloat16


def operands(m=256, k=128, n=128, groups=4, dtype=BF16):
    return jnp.ones((m, k), dtype), jnp.ones((groups, k, n), dtype), jnp.full((groups,), m // 4)


def test_the_gate_declines_what_it_cannot_run():
    kernel = MosaicGpuGroupedMatmul()
    assert "CUDA GPU backend" in kernel.availability("cpu")
    lhs, rhs, sizes = operands()
    assert kernel.is_supported(lhs, rhs, sizes, "gpu") is True
    assert "CUDA GPU backend" in kernel.is_supported(lhs, rhs, sizes, "cpu").reason
    narrow = kernel.is_supported(*operands(k=96), "gpu")
    assert "multiples of 128" in narrow.reason
    assert "dtypes" in kernel.is_supported(*operands(dtype=jnp.float32), "gpu").reason


def test_dispatch_picks_it_for_a_gpu_call_only():
    lhs, rhs, sizes = operands()
    name, kernel = select_grouped_matmul(lhs, rhs, sizes, "gpu")
    assert name == "mosaic_gpu_gmm" and isinstance(kernel, MosaicGpuGroupedMatmul)
    assert select_grouped_matmul(lhs, rhs, sizes, "cpu")[0] == "xla"
    assert select_grouped_matmul(*operands(n=64), "gpu")[0] == "xla"


def test_a_sharded_call_falls_back_to_xla():
    import numpy as np
    from jax.sharding import Mesh

    from axplug.api.sharding import sharding_scope

    mesh = Mesh(np.array(jax.devices()[:2]), ("data",))
    with sharding_scope(mesh):
        assert select_grouped_matmul(*operands(), "gpu")[0] == "xla"


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU")
class TestMosaicGroupedMatmulOnGpu(GroupedMatmulConformance):
    @pytest.fixture
    def kernel(self):
        return MosaicGpuGroupedMatmul()

    @pytest.fixture
    def backend(self):
        return "gpu"

    @pytest.fixture
    def problem_shapes(self):
        return 512, 128, 256, 4
