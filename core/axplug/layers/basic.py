"""Linear projections and token embeddings."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from axplug.config import REQUIRED, Required, config_class
from axplug.layers.base import BaseLayer, ParameterSpec
from axplug.sharding import constrain

__all__ = ["Linear", "Embedding"]


class Linear(BaseLayer):
    """y = x @ weight (+ bias), contracting the last axis."""

    @config_class
    class Config(BaseLayer.Config):
        input_dim: Required[int] = REQUIRED
        output_dim: Required[int] = REQUIRED
        bias: bool = False
        # Logical mesh axes of the [input_dim, output_dim] weight.
        mesh_axes: tuple[str | None, str | None] = ("embed", "mlp")
        init_scale: float = 1.0

    def _create_layer_parameter_specs(self) -> dict[str, ParameterSpec]:
        cfg = self._config
        specs = {
            "weight": ParameterSpec(
                shape=(cfg.input_dim, cfg.output_dim),
                dtype=self.dtype,
                mesh_axes=cfg.mesh_axes,
                initializer=jax.nn.initializers.variance_scaling(
                    cfg.init_scale, "fan_in", "truncated_normal"
                ),
            )
        }
        if cfg.bias:
            specs["bias"] = ParameterSpec(
                shape=(cfg.output_dim,),
                dtype=self.dtype,
                mesh_axes=(cfg.mesh_axes[1],),
                initializer=jax.nn.initializers.zeros,
                weight_decay_scale=0.0,
            )
        return specs

    def forward(self, x: jax.Array) -> jax.Array:
        params = self.parameters
        y = jnp.einsum("...i,io->...o", self.cast(x), self.cast(params["weight"]))
        if "bias" in params:
            y = y + self.cast(params["bias"])
        return y


class Embedding(BaseLayer):
    """Token ids -> vectors; `attend` maps vectors back to logits with the same table."""

    @config_class
    class Config(BaseLayer.Config):
        num_embeddings: Required[int] = REQUIRED
        dim: Required[int] = REQUIRED
        mesh_axes: tuple[str | None, str | None] = ("vocab", "embed")
        init_scale: float = 1.0

    def _create_layer_parameter_specs(self) -> dict[str, ParameterSpec]:
        cfg = self._config
        return {
            "weight": ParameterSpec(
                shape=(cfg.num_embeddings, cfg.dim),
                dtype=self.dtype,
                mesh_axes=cfg.mesh_axes,
                initializer=jax.nn.initializers.normal(cfg.init_scale),
            )
        }

    def forward(self, ids: jax.Array) -> jax.Array:
        # [batch, seq] -> [batch, seq, dim]
        # Gathered over its FSDP shards like any weight before use: a lookup into a table
        # split along `dim` would gather every row's ids instead, which grows with the batch.
        table = constrain(self.cast(self.parameters["weight"]), (self._config.mesh_axes[0], None))
        return jnp.take(table, ids, axis=0)

    def attend(self, x: jax.Array) -> jax.Array:
        # [batch, seq, dim] -> [batch, seq, num_embeddings]
        return jnp.einsum("...d,vd->...v", self.cast(x), self.cast(self.parameters["weight"]))
