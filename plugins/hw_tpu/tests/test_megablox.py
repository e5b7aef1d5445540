"""Megablox's grouped matmul as an axplug kernel, checked on CPU: its numerics in the Pallas
interpreter through the conformance kit, its gate, and the real dispatch choosing it for a
TPU call (and the MoE `ragged` dispatch running on it)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

axplug_tpu = pytest.importorskip("axplug_tpu")

from axplug_testing import GroupedMatmulConformance  # noqa: E402

from axplug.api.kernels import select_grouped_matmul  # noqa: E402


def interpreted():
    kernel = axplug_tpu.MegabloxGroupedMatmul()
    kernel.interpret = True
    return kernel


class TestMegabloxInTheInterpreter(GroupedMatmulConformance):
    @pytest.fixture
    def kernel(self):
        return interpreted()

    @pytest.fixture
    def backend(self):
        return "tpu"  # the gate's answer for a TPU; the interpreter runs it here

    @pytest.fixture
    def problem_shapes(self):
        return 256, 128, 128, 4  # the (128, 128, 128) tiles


def test_the_gate_declines_what_it_cannot_run():
    kernel = axplug_tpu.MegabloxGroupedMatmul()
    assert kernel.availability("tpu") is None and "needs a TPU" in kernel.availability("cpu")
    lhs, rhs, sizes = jnp.ones((256, 128)), jnp.ones((4, 128, 128)), jnp.full((4,), 64)
    assert kernel.is_supported(lhs, rhs, sizes, "tpu") is True
    assert "TPU backend" in kernel.is_supported(lhs, rhs, sizes, "cpu").reason
    odd = kernel.is_supported(jnp.ones((256, 96)), jnp.ones((4, 96, 128)), sizes, "tpu")
    assert "multiple of the (128, 128, 128) tiles" in odd.reason
    mixed = kernel.is_supported(lhs.astype(jnp.bfloat16), rhs, sizes, "tpu")
    assert "dtypes" in mixed.reason


def test_dispatch_picks_it_for_a_tpu_call_only():
    lhs, rhs, sizes = jnp.ones((256, 128)), jnp.ones((4, 128, 128)), jnp.full((4,), 64)
    name, kernel = select_grouped_matmul(lhs, rhs, sizes, "tpu")
    assert name == "megablox_gmm" and isinstance(kernel, axplug_tpu.MegabloxGroupedMatmul)
    assert select_grouped_matmul(lhs, rhs, sizes, "cpu")[0] == "xla"
    assert select_grouped_matmul(jnp.ones((200, 128)), rhs, sizes, "tpu")[0] == "xla"


def test_a_sharded_call_falls_back_to_xla():
    from jax.sharding import Mesh

    from axplug.api.sharding import sharding_scope

    if jax.device_count() < 2:
        pytest.skip("needs 2 devices (the root conftest.py sets 8 fake CPU devices)")
    mesh = Mesh(np.array(jax.devices()[:2]), ("data",))
    lhs, rhs, sizes = jnp.ones((256, 128)), jnp.ones((4, 128, 128)), jnp.full((4,), 64)
    with sharding_scope(mesh):
        answer = axplug_tpu.MegabloxGroupedMatmul().is_supported(lhs, rhs, sizes, "tpu")
        assert "multi-device mesh" in answer.reason
        assert select_grouped_matmul(lhs, rhs, sizes, "tpu")[0] == "xla"


def test_the_moe_ragged_dispatch_runs_on_it(monkeypatch):
    pytest.importorskip("axplug_moe")
    from axplug_moe import MoEFeedForward, RaggedDispatch

    from axplug.api.layers import functional

    cfg = MoEFeedForward.default_config().set(
        input_dim=128, hidden_dim=128, num_experts=4, dispatch=RaggedDispatch.default_config()
    )
    cfg.router.set(top_k=2, capacity_factor=None)
    model = cfg.instantiate(parent=None)
    params = model.initialize_parameters_recursively(jax.random.PRNGKey(0))
    x = jax.random.normal(jax.random.PRNGKey(1), (2, 64, 128))  # 256 choices

    def loss(params):
        y, _ = functional(model, prng_key=None, state=params, inputs=(x,), is_training=True)
        return jnp.sum(y**2), y

    # Jitted: one program each, not one per op (the selection runs as it is traced).
    (_, want), want_grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(params)
    kernel, chosen = interpreted(), []

    def select(lhs, rhs, sizes, backend=None):
        chosen.append(select_grouped_matmul(lhs, rhs, sizes, "tpu"))  # the real one
        return "megablox_gmm", kernel

    # where the MoE dispatch looks it up: the core's module (the face is a re-export)
    monkeypatch.setattr("axplug.kernels.grouped.select_grouped_matmul", select)
    (_, got), got_grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(params)
    assert [name for name, _ in chosen] == ["megablox_gmm"] * 3  # up, gate, out
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4),
                 got_grads, want_grads)  # fmt: skip
