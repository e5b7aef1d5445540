"""Remat policies that offload saved activations to pinned host memory."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from axplug_testing import tiny_trainer_config


def trainer_for(policy, tmp_path):
    cfg = tiny_trainer_config(
        tmp_path,
        "input.seq_len=64",
        "mesh.mesh_shape=(1, 1, 1, 1, 1)",
        preset="llama-tiny",
        modifiers=[f"scan_layers:remat_policy={policy}"],
    )
    return cfg.instantiate(devices=jax.devices()[:1])


def step_grads(trainer):
    from axplug.sharding import scoped
    from axplug.trainer.step import loss_fn

    state = trainer.init_state()
    batch = trainer.put_batch(trainer.input.batch(0))
    loss = loss_fn(trainer.model, trainer.aux_loss)
    grad = jax.jit(scoped(jax.value_and_grad(lambda p: loss(p, batch, None)[0]), trainer.mesh))
    return jax.device_get(grad(state["params"]))


@pytest.mark.parametrize("policy", ["offload", "offload_outputs"])
def test_offload_keeps_the_loss_and_gradients(tmp_path, policy):
    want_loss, want = step_grads(trainer_for("full", tmp_path / "full"))
    got_loss, got = step_grads(trainer_for(policy, tmp_path / policy))
    np.testing.assert_allclose(got_loss, want_loss, rtol=1e-6)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-8), got, want)


@pytest.mark.parametrize("policy, copies", [("offload", 1), ("offload_outputs", 2), ("full", 0)])
def test_the_program_places_saved_activations_in_host_memory(tmp_path, policy, copies):
    """Lowered for a GPU, the step annotates each offloaded activation with pinned_host:
    the layer input, and with `offload_outputs` the attention output too (the backward pass
    never needs the feed-forward output, so it is not saved at all)."""
    trainer = trainer_for(policy, tmp_path)
    token = jax.ShapeDtypeStruct((8, 64), jnp.int32, sharding=trainer.batch_sharding)
    traced = trainer._train_step.trace(
        trainer.layout.abstract, {"input_ids": token, "target_labels": token}
    )
    text = traced.lower(lowering_platforms=("cuda",)).as_text()
    # To host in the scanned forward, back to the device in the backward: per named value.
    assert text.count('_xla_buffer_placement = "pinned_host"') == copies
    assert ("f32<host>" in str(traced.jaxpr)) == bool(copies)
