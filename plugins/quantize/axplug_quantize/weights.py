"""Weight-only quantization for serving: each Linear's weight stored in 8 bits (int8, or fp8
e4m3) with a float32 scale per output channel, multiplied in the compute dtype. Decoding
reads every weight once per step, so a quarter of float32's bytes (half of bfloat16's) is
what it saves; the activations and the KV cache stay as they are."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from axplug.api import ParameterSpec
from axplug.api.config import ConfigError, config_class, replace_config
from axplug.api.layers import Linear

__all__ = ["WEIGHT_FORMATS", "WeightOnlyLinear", "quantize_weights", "quantized_weight"]

# Storage dtype and its largest value, by format name.
WEIGHT_FORMATS = {"int8": (jnp.int8, 127.0), "fp8": (jnp.float8_e4m3fn, 448.0)}


def quantized_weight(w: jax.Array, fmt: str) -> tuple[jax.Array, jax.Array]:
    """(`w` [..., in, out] in `fmt`, its float32 scale per output channel [..., out]):
    symmetric, the channel's largest magnitude at the format's largest value; int8 rounds to
    the nearest integer, fp8 to the nearest e4m3 value."""
    dtype, top = WEIGHT_FORMATS[fmt]
    w = w.astype(jnp.float32)
    scale = jnp.max(jnp.abs(w), axis=-2) * (1.0 / top)  # as XLA computes a division by it
    scale = jnp.where(scale == 0, 1.0, scale)
    q = w / scale[..., None, :]
    return (jnp.round(q) if fmt == "int8" else q).astype(dtype), scale


class WeightOnlyLinear(Linear):
    """A Linear whose `weight` [in, out] is stored in `format` (int8 or fp8 e4m3) with a
    `scale` [out]: y = (x @ weight) * scale, the weight converted to the compute dtype where
    the product reads it. For serving (`quantize_weights`); not for training (no gradients
    reach an integer weight)."""

    @config_class
    class Config(Linear.Config):
        format: str = "int8"

    def __init__(self, cfg: Config, *, parent=None):
        super().__init__(cfg, parent=parent)
        if cfg.format not in WEIGHT_FORMATS:
            raise ConfigError(f"{self.path}.format: unknown format {cfg.format!r}; choose from "
                              f"{sorted(WEIGHT_FORMATS)}")  # fmt: skip

    def _create_layer_parameter_specs(self) -> dict[str, ParameterSpec]:
        cfg = self._config
        specs = super()._create_layer_parameter_specs()
        zeros = jax.nn.initializers.zeros
        specs["weight"] = dataclasses.replace(specs["weight"], initializer=zeros,
                                              dtype=WEIGHT_FORMATS[cfg.format][0])  # fmt: skip
        specs["scale"] = ParameterSpec(shape=(cfg.output_dim,), dtype=jnp.float32,
                                       mesh_axes=(cfg.mesh_axes[1],),
                                       initializer=jax.nn.initializers.ones)  # fmt: skip
        return specs

    def project(self, x: jax.Array) -> jax.Array:
        params = self.parameters
        x = self.cast(x)
        y = jnp.einsum("...i,io->...o", x, params["weight"].astype(x.dtype))
        y = y * params["scale"].astype(x.dtype)
        if "bias" in params:
            y = y + self.cast(params["bias"])
        return y


def quantize_weights(
    model_cfg: Any, params: dict, fmt: str = "int8", *, mesh: Any, axis_rules: Any,
    targets: tuple[str, ...] = ("attention", "feed_forward"),
) -> tuple[Any, dict]:  # fmt: skip
    """(model config, parameters) with every float `Linear` under `targets` (path
    components) a `WeightOnlyLinear` of `fmt`, its weight quantized; laid out on `mesh`.
    Embeddings, norms, the LM head and adapters stay as they are."""
    from axplug.api.interop import flatten, unflatten
    from axplug.api.sharding import parameter_shardings

    if fmt not in WEIGHT_FORMATS:
        raise ConfigError(f"unknown weight format {fmt!r}; choose from {sorted(WEIGHT_FORMATS)}")
    wanted = set(targets)
    cfg = replace_config(
        model_cfg, target=Linear, new_cfg=WeightOnlyLinear.default_config().set(format=fmt),
        where=lambda path, _: bool(wanted & set(path.split("."))), missing_ok=True,
    )  # fmt: skip
    model = cfg.instantiate(parent=None, _path="model")
    shardings = flatten(parameter_shardings(model.create_parameter_specs_recursively(), mesh,
                                            axis_rules))  # fmt: skip
    abstract = flatten(jax.eval_shape(model.initialize_parameters_recursively,
                                      jax.random.PRNGKey(0)))  # fmt: skip
    flat = flatten(params)
    for key, shape in abstract.items():
        if key.endswith(".weight") and shape.dtype == WEIGHT_FORMATS[fmt][0]:
            scale_key = key.removesuffix("weight") + "scale"
            quantize = jax.jit(quantized_weight, static_argnums=1,
                               out_shardings=(shardings[key], shardings[scale_key]))  # fmt: skip
            flat[key], flat[scale_key] = quantize(flat[key], fmt)
    return cfg, unflatten(flat)
