"""A low-rank adapter for a Linear's `adapter` slot: delta(x) = (alpha / rank) dropout(x) A B."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from axplug.api import ParameterSpec
from axplug.api.config import REQUIRED, ConfigError, Required, config_class
from axplug.api.layers import BaseLayer

__all__ = ["LoRAAdapter"]


class LoRAAdapter(BaseLayer):
    """The low-rank update of LoRA (Hu et al., 2021) in a `Linear`'s `adapter` slot:
    `lora_a` [in, rank] (Kaiming-uniform, as PEFT) and `lora_b` [rank, out] (zeros: the model
    starts as its base), scaled by alpha / rank.

    The Linear gives its `input_dim`, `output_dim` and `mesh_axes`, so the adapters are
    sharded like the weight they adapt (`lora_a` along its input axis, `lora_b` along its
    output axis), and any Linear subclass takes one (`QuantizedLinear`: QLoRA-style, the base
    quantized and frozen, the adapter in float). `delta_weight` merges it into the weight
    (`axplug.layers.fold_layers`: `export-hf` writes the merged model)."""

    @config_class
    class Config(BaseLayer.Config):
        input_dim: Required[int] = REQUIRED
        output_dim: Required[int] = REQUIRED
        mesh_axes: tuple[str | None, str | None] = ("embed", "mlp")
        rank: int = 8
        alpha: float = 16.0
        dropout: float = 0.0  # on the adapter's input, in training
        # False: lora_b random too (PEFT's init_lora_weights=False), the model no longer
        # starting as its base; for tests of the adapter's gradients.
        zero_init: bool = True
        # The Linear modules that get one (`q`, `v`, `wo`: one config builds several
        # projections); None: every Linear the config builds.
        modules: tuple[str, ...] | None = None

    def __init__(self, cfg: Config, *, parent=None):
        super().__init__(cfg, parent=parent)
        if cfg.rank < 1:
            raise ConfigError(f"{self.path}.rank: must be >= 1, got {cfg.rank}")
        if not 0.0 <= cfg.dropout < 1.0:
            raise ConfigError(f"{self.path}.dropout: must be in [0, 1), got {cfg.dropout}")

    @classmethod
    def applies_to(cls, cfg: Config, module_name: str) -> bool:
        """Whether the Linear named `module_name` gets this adapter."""
        return cfg.modules is None or module_name in cfg.modules

    @staticmethod
    def scale(cfg: Config) -> float:
        """The adapter's multiplier, alpha / rank (PEFT's `scaling`)."""
        return cfg.alpha / cfg.rank

    def _create_layer_parameter_specs(self) -> dict[str, ParameterSpec]:
        cfg = self._config
        axis_in, axis_out = cfg.mesh_axes
        return {
            "lora_a": ParameterSpec(
                shape=(cfg.input_dim, cfg.rank),
                dtype=self.dtype,
                mesh_axes=(axis_in, None),
                # PEFT's kaiming_uniform_(a=sqrt(5)): uniform within 1/sqrt(fan_in).
                initializer=jax.nn.initializers.variance_scaling(1 / 3, "fan_in", "uniform"),
            ),
            "lora_b": ParameterSpec(
                shape=(cfg.rank, cfg.output_dim),
                dtype=self.dtype,
                mesh_axes=(None, axis_out),
                initializer=jax.nn.initializers.zeros
                if cfg.zero_init
                else jax.nn.initializers.variance_scaling(1 / 3, "fan_in", "uniform"),
            ),
        }

    def forward(self, x: jax.Array) -> jax.Array:
        cfg = self._config
        params = self.parameters
        h = self.cast(x)
        if self.is_training and cfg.dropout > 0.0:
            keep = jax.random.bernoulli(self.prng_key, 1.0 - cfg.dropout, h.shape)
            h = jnp.where(keep, h / (1.0 - cfg.dropout), 0).astype(h.dtype)
        low = jnp.einsum("...i,ir->...r", h, self.cast(params["lora_a"]))
        update = jnp.einsum("...r,ro->...o", low, self.cast(params["lora_b"]))
        return self.scale(cfg) * update

    @classmethod
    def delta_weight(cls, cfg: Config, params: dict) -> jax.Array:
        """(alpha / rank) A @ B in float32, [..., in, out] (leading axes kept)."""
        a, b = jnp.float32(params["lora_a"]), jnp.float32(params["lora_b"])
        return cls.scale(cfg) * jnp.einsum("...ir,...ro->...io", a, b)
