"""The trainer's non-trainable state updates (`ParameterSpec.update`): what fp8 amax histories
of axplug-quantize and any layer's counters rely on, tested with a core layer."""

import jax
import jax.numpy as jnp
import numpy as np
from axplug_testing import tiny_trainer_config, train_steps

from axplug.api import ParameterSpec
from axplug.config import replace_config
from axplug.layers import RMSNorm


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
    cfg = tiny_trainer_config(tmp_path, "learner.weight_decay=0.5", "learner.learning_rate=0.1",
                              preset="llama-tiny", max_steps=3)  # fmt: skip
    cfg = replace_config(cfg, target=RMSNorm, new_cfg=CountingNorm.default_config())
    state, _ = train_steps(cfg.instantiate(), 3)
    norm = state["params"]["decoder"]["output_norm"]
    assert float(norm["calls"]) == 3.0  # one update per step, no decay, no optimizer step
    np.testing.assert_array_equal(norm["untouched"], np.ones(2))
    assert float(norm["scale"].mean()) != 1.0  # the trained parameter did move
