"""The trainer's non-trainable state updates (`ParameterSpec.update`): what fp8 amax histories
of axplug-quantize and any layer's counters rely on, tested with a core layer."""

import jax
import jax.numpy as jnp
import numpy as np

from axplug.config import replace_config
from axplug.layers import ParameterSpec, RMSNorm
from axplug.presets import preset_config


def tiny(tmp_path, *modifiers, steps=3, extra=()):
    from axplug.summary import JsonlWriter

    cfg = preset_config(
        "llama-tiny",
        modifiers=list(modifiers),
        overrides=[
            f"output_dir={str(tmp_path)!r}",
            f"max_steps={steps}",
            "compilation_cache_dir=None",
            "checkpoint_every=3",
            "log_every=1",
            "input.seq_len=64",
            "input.batch_size=8",
            "mesh.mesh_shape=(1, 1, 1, 1, 1)",
            *extra,
        ],
    )
    return cfg.clone(summary_writers=[JsonlWriter.default_config()])


class CountingNorm(RMSNorm):
    """An RMSNorm with a `calls` counter updated each step and a state it never updates."""

    def _create_layer_parameter_specs(self):
        specs = super()._create_layer_parameter_specs()
        zeros = jax.nn.initializers.zeros
        specs["calls"] = ParameterSpec(
            (), jnp.float32, (), zeros, weight_decay_scale=1.0, update="state"
        )
        specs["untouched"] = ParameterSpec(
            (2,), jnp.float32, (None,), jax.nn.initializers.ones, update="state"
        )
        return specs

    def forward(self, x):
        if self.is_training:
            self.add_state_update("calls", self.parameters["calls"] + 1)
        # `untouched` is read (so it has a gradient) but never updated: it must stay ones.
        return super().forward(x) * jnp.sum(self.parameters["untouched"]) / 2


def test_state_updates_replace_non_trainable_parameters(tmp_path):
    cfg = tiny(tmp_path, steps=3, extra=["learner.weight_decay=0.5", "learner.learning_rate=0.1"])
    cfg = replace_config(cfg, target=RMSNorm, new_cfg=CountingNorm.default_config())
    trainer = cfg.instantiate(devices=jax.devices()[:1])
    trainer.run()
    norm = trainer.state["params"]["decoder"]["output_norm"]
    assert float(norm["calls"]) == 3.0  # one update per step, no decay, no optimizer step
    np.testing.assert_array_equal(norm["untouched"], np.ones(2))
    assert float(norm["scale"].mean()) != 1.0  # the trained parameter did move
