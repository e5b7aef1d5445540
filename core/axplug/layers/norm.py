"""RMSNorm and LayerNorm, computed in float32 whatever the compute dtype."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from axplug.config import REQUIRED, Required, config_class
from axplug.layers.base import BaseLayer, ParameterSpec

__all__ = ["RMSNorm", "LayerNorm"]


class RMSNorm(BaseLayer):
    """x / rms(x) * scale."""

    @config_class
    class Config(BaseLayer.Config):
        input_dim: Required[int] = REQUIRED
        eps: float = 1e-6

    @classmethod
    def hf_read(cls, cfg: Config, fields) -> None:
        cfg.eps = fields.number("rms_norm_eps")

    @classmethod
    def hf_write(cls, cfg: Config) -> dict:
        return {"rms_norm_eps": cfg.eps}

    def _create_layer_parameter_specs(self) -> dict[str, ParameterSpec]:
        return {
            "scale": ParameterSpec(
                shape=(self._config.input_dim,),
                dtype=self.dtype,
                mesh_axes=("embed",),
                initializer=jax.nn.initializers.ones,
                weight_decay_scale=0.0,
            )
        }

    def forward(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self._config.eps)
        return self.cast(y * self.parameters["scale"].astype(jnp.float32))


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
        if not cfg.bias:
            raise ValueError("a LayerNorm without bias (Hugging Face's have one)")
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
