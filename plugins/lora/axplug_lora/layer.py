"""A Linear with a low-rank adapter: y = x @ W + (alpha / rank) * dropout(x) @ A @ B."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from axplug.config import ConfigError, config_class
from axplug.layers import Linear, ParameterSpec

__all__ = ["LoRALinear"]


class LoRALinear(Linear):
    """A `Linear` plus a trainable low-rank update (Hu et al., 2021), `lora_a` [in, rank]
    (Kaiming-uniform, as PEFT) and `lora_b` [rank, out] (zeros: the model starts as its base).

    The adapters are sharded like the weight they adapt: `lora_a` along its input axis,
    `lora_b` along its output axis. `fold_parameters` merges them into the weight
    (`axplug.layers.fold_layers`: `export-hf` writes the merged model)."""

    @config_class
    class Config(Linear.Config):
        rank: int = 8
        alpha: float = 16.0
        dropout: float = 0.0  # on the adapter's input, in training
        # The module names that get an adapter (`q`, `v`, `wo`: one config serves several
        # projections); None: every module of this config. The others compute as a Linear.
        modules: tuple[str, ...] | None = None

    def __init__(self, cfg: Config, *, parent=None):
        super().__init__(cfg, parent=parent)
        if cfg.rank < 1:
            raise ConfigError(f"{self.path}.rank: must be >= 1, got {cfg.rank}")
        if not 0.0 <= cfg.dropout < 1.0:
            raise ConfigError(f"{self.path}.dropout: must be in [0, 1), got {cfg.dropout}")

    @staticmethod
    def scale(cfg: Config) -> float:
        """The adapter's multiplier, alpha / rank (PEFT's `scaling`)."""
        return cfg.alpha / cfg.rank

    @property
    def adapted(self) -> bool:
        """Whether this module has an adapter (its name is one of `modules`)."""
        modules = self._config.modules
        return modules is None or self.name in modules

    def _create_layer_parameter_specs(self) -> dict[str, ParameterSpec]:
        cfg = self._config
        specs = super()._create_layer_parameter_specs()
        if not self.adapted:
            return specs
        axis_in, axis_out = cfg.mesh_axes
        specs["lora_a"] = ParameterSpec(
            shape=(cfg.input_dim, cfg.rank),
            dtype=self.dtype,
            mesh_axes=(axis_in, None),
            # PEFT's kaiming_uniform_(a=sqrt(5)): uniform within 1/sqrt(fan_in).
            initializer=jax.nn.initializers.variance_scaling(1 / 3, "fan_in", "uniform"),
        )
        specs["lora_b"] = ParameterSpec(
            shape=(cfg.rank, cfg.output_dim),
            dtype=self.dtype,
            mesh_axes=(None, axis_out),
            initializer=jax.nn.initializers.zeros,
        )
        return specs

    def forward(self, x: jax.Array) -> jax.Array:
        cfg = self._config
        params = self.parameters
        y = super().forward(x)
        if "lora_a" not in params:
            return y
        h = self.cast(x)
        if self.is_training and cfg.dropout > 0.0:
            keep = jax.random.bernoulli(self.prng_key, 1.0 - cfg.dropout, h.shape)
            h = jnp.where(keep, h / (1.0 - cfg.dropout), 0).astype(h.dtype)
        low = jnp.einsum("...i,ir->...r", h, self.cast(params["lora_a"]))
        update = jnp.einsum("...r,ro->...o", low, self.cast(params["lora_b"]))
        return y + (self.scale(cfg) * update).astype(y.dtype)

    @classmethod
    def folded_config(cls) -> Linear.Config:
        return Linear.default_config()

    @classmethod
    def fold_parameters(cls, cfg: Config, params: dict) -> dict:
        """The Linear's parameters: weight + (alpha / rank) A @ B (leading axes kept)."""
        if "lora_a" not in params:
            return params
        a, b, w = params["lora_a"], params["lora_b"], params["weight"]
        delta = jnp.einsum("...ir,...ro->...io", jnp.float32(a), jnp.float32(b))
        merged = (jnp.float32(w) + cls.scale(cfg) * delta).astype(w.dtype)
        return {**{k: v for k, v in params.items() if not k.startswith("lora_")}, "weight": merged}
