"""RMSNorm and LayerNorm, computed in float32 whatever the compute dtype."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from axplug.config import REQUIRED, Required, config_class
from axplug.layers.base import BaseLayer, ParameterSpec

__all__ = ["RMSNorm", "LayerNorm"]


class RMSNorm(BaseLayer):
    """x / rms(x) * (scale + scale_offset), in float32, cast to the compute dtype at the end.

    `scale_offset=1.0` is Gemma's `(1 + w)` form; the stored `scale` then starts at zeros
    (in general at `1 - scale_offset`), so every offset starts as the identity scale.
    """

    @config_class
    class Config(BaseLayer.Config):
        input_dim: Required[int] = REQUIRED
        eps: float = 1e-6
        # Added to the stored scale in the forward pass (Gemma: 1.0, scale initialized to 0).
        scale_offset: float = 0.0

    @classmethod
    def hf_read(cls, cfg: Config, fields) -> None:
        cfg.eps = fields.number("rms_norm_eps")

    @classmethod
    def hf_write(cls, cfg: Config) -> dict:
        return {"rms_norm_eps": cfg.eps}

    def _create_layer_parameter_specs(self) -> dict[str, ParameterSpec]:
        offset = self._config.scale_offset
        if offset == 0.0:
            initializer = jax.nn.initializers.ones
        elif offset == 1.0:
            initializer = jax.nn.initializers.zeros
        else:
            initializer = jax.nn.initializers.constant(1.0 - offset)
        return {
            "scale": ParameterSpec(
                shape=(self._config.input_dim,),
                dtype=self.dtype,
                mesh_axes=("embed",),
                initializer=initializer,
                weight_decay_scale=0.0,
            )
        }

    def forward(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self._config.eps)
        scale = self.parameters["scale"].astype(jnp.float32)
        if self._config.scale_offset != 0.0:
            scale = scale + self._config.scale_offset
        return self.cast(y * scale)


class LayerNorm(BaseLayer):
    """(x - mean) / std * scale + bias."""

    @config_class
    class Config(BaseLayer.Config):
        input_dim: Required[int] = REQUIRED
        eps: float = 1e-5
        bias: bool = True

    @classmethod
    def hf_read(cls, cfg: Config, fields) -> None:
        cfg.eps = fields.number("layer_norm_eps")

    @classmethod
    def hf_write(cls, cfg: Config) -> dict:
        # With or without bias: whether a family's norms have one is the family's layout
        # (Cohere's have none), and its tensor rules export the bias only where there is one.
        return {"layer_norm_eps": cfg.eps}

    def _create_layer_parameter_specs(self) -> dict[str, ParameterSpec]:
        dim = self._config.input_dim
        specs = {
            "scale": ParameterSpec(
                (dim,), self.dtype, ("embed",), jax.nn.initializers.ones, weight_decay_scale=0.0
            )
        }
        if self._config.bias:
            specs["bias"] = ParameterSpec(
                (dim,), self.dtype, ("embed",), jax.nn.initializers.zeros, weight_decay_scale=0.0
            )
        return specs

    def forward(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        mean = jnp.mean(x32, axis=-1, keepdims=True)
        var = jnp.mean(jnp.square(x32 - mean), axis=-1, keepdims=True)
        y = (x32 - mean) * jax.lax.rsqrt(var + self._config.eps)
        y = y * self.parameters["scale"].astype(jnp.float32)
        if "bias" in self.parameters:
            y = y + self.parameters["bias"].astype(jnp.float32)
        return self.cast(y)
