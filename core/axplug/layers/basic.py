"""Linear projections and token embeddings."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from axplug.config import REQUIRED, ConfigError, InstantiableConfig, Required, config_class
from axplug.layers.base import BaseLayer, ParameterSpec
from axplug.module import Module
from axplug.sharding import constrain

__all__ = ["Linear", "Embedding"]


class Linear(BaseLayer):
    """y = x @ weight (+ bias) (+ adapter(x)), contracting the last axis.

    `adapter` is an optional child that adds a learned delta computed from the same input
    (a plugin's low-rank adapter); it is built with this layer's `input_dim`, `output_dim`
    and `mesh_axes`, and works over any subclass that computes its product in `project`
    (a quantized one too). An adapter class with `delta_weight(cfg, params)` folds into the
    weight (`fold_layers`: a merged export).
    """

    @config_class
    class Config(BaseLayer.Config):
        input_dim: Required[int] = REQUIRED
        output_dim: Required[int] = REQUIRED
        bias: bool = False
        # Logical mesh axes of the [input_dim, output_dim] weight.
        mesh_axes: tuple[str | None, str | None] = ("embed", "mlp")
        init_scale: float = 1.0
        adapter: InstantiableConfig | None = None

    def __init__(self, cfg: Config, *, parent: Module | None = None):
        super().__init__(cfg, parent=parent)
        adapter = cfg.adapter
        if adapter is None:
            return
        if not adapter.klass.applies_to(adapter, self.name):
            return
        if type(self).forward is not Linear.forward:
            raise ConfigError(
                f"{self.path}.adapter: {type(self).__qualname__} overrides forward, which would "
                "leave the adapter out; it must compute its product in `project` instead"
            )
        self._add_child(
            "adapter",
            adapter.clone(
                input_dim=cfg.input_dim, output_dim=cfg.output_dim, mesh_axes=cfg.mesh_axes
            ),
        )

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

    def project(self, x: jax.Array) -> jax.Array:
        """x @ weight (+ bias): what a subclass computes otherwise (quantized)."""
        params = self.parameters
        y = jnp.einsum("...i,io->...o", self.cast(x), self.cast(params["weight"]))
        if "bias" in params:
            y = y + self.cast(params["bias"])
        return y

    def forward(self, x: jax.Array) -> jax.Array:
        y = self.project(x)
        if "adapter" in self.children:
            y = y + self.adapter(x).astype(y.dtype)
        return y

    @classmethod
    def folded_config(cls, cfg: Config) -> Config:
        """The config once the adapter is merged into the weight."""
        return cfg.clone(adapter=None) if cfg.adapter is not None else cfg

    @classmethod
    def fold_parameters(cls, cfg: Config, params: dict) -> dict:
        """The parameters with the adapter's delta added to the weight (leading axes kept)."""
        if cfg.adapter is None or "adapter" not in params:
            return params
        delta = cfg.adapter.klass.delta_weight(cfg.adapter, params["adapter"])
        w = params["weight"]
        merged = (jnp.asarray(w, jnp.float32) + delta).astype(w.dtype)
        return {**{k: v for k, v in params.items() if k != "adapter"}, "weight": merged}


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
