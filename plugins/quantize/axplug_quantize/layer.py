"""Quantized training matmuls: int8 (dynamic per-token / per-channel scales, int32
accumulation), fp8 (e4m3 forward, e5m2 gradients, delayed scaling from amax histories) and
the current-scaling fp8 recipes of `axplug_quantize.recipes` (tensorwise, rowwise, MXFP8)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from axplug.api import ParameterSpec
from axplug.api.config import ConfigError, config_class
from axplug.api.layers import Linear
from axplug_quantize.recipes import CURRENT_RECIPES, check_shapes, recipe_matmul

__all__ = ["QuantizedLinear", "QUANTIZE_MODES", "int8_matmul", "fp8_matmul"]

QUANTIZE_MODES = ("int8", "fp8", *CURRENT_RECIPES)
_INT8_MAX = 127.0
_E4M3, _E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2
_E4M3_MAX, _E5M2_MAX = float(jnp.finfo(_E4M3).max), float(jnp.finfo(_E5M2).max)


# --- int8 ------------------------------------------------------------------------------------


def _int8(x: jax.Array, axis: int) -> tuple[jax.Array, jax.Array]:
    """`x` as int8 with a float32 scale per slice along `axis` (symmetric, round to nearest)."""
    x = x.astype(jnp.float32)
    scale = jnp.max(jnp.abs(x), axis=axis, keepdims=True) / _INT8_MAX
    scale = jnp.where(scale == 0, 1.0, scale)
    return jnp.round(x / scale).astype(jnp.int8), scale


def _int8_dot(a: jax.Array, b: jax.Array) -> jax.Array:
    """[m, k] x [k, n] int8 -> int32, the accelerator's integer matmul."""
    return jax.lax.dot_general(a, b, (((1,), (0,)), ((), ())), preferred_element_type=jnp.int32)


def _int8_forward(x2: jax.Array, w: jax.Array) -> jax.Array:
    xq, sx = _int8(x2, axis=1)  # a scale per token
    wq, sw = _int8(w, axis=0)  # a scale per output channel
    return _int8_dot(xq, wq).astype(jnp.float32) * sx * sw


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def int8_matmul(x2: jax.Array, w: jax.Array, int8_backward: bool) -> jax.Array:
    """[tokens, in] @ [in, out] through int8 x int8 -> int32 (float32 out).

    Backward: straight-through; the two gradient matmuls run in int8 too with
    `int8_backward` (dx: per-token x per-input-channel scales; dw: per-channel scales over
    the tokens), else in float32.
    """
    return _int8_forward(x2, w)


def _int8_fwd(x2, w, int8_backward):
    return _int8_forward(x2, w), (x2, w)


def _int8_bwd(int8_backward, residuals, dy):
    x2, w = residuals
    dy = dy.astype(jnp.float32)
    if not int8_backward:
        dx = dy @ w.astype(jnp.float32).T
        dw = x2.astype(jnp.float32).T @ dy
    else:
        dyq, sdy = _int8(dy, axis=1)  # per token
        wq, sw = _int8(w, axis=1)  # per input channel (the rows dx is made of)
        dx = _int8_dot(dyq, wq.T).astype(jnp.float32) * sdy * sw.T
        xq, sx = _int8(x2, axis=0)  # per input channel, over tokens
        dyq2, sdy2 = _int8(dy, axis=0)  # per output channel, over tokens
        dw = _int8_dot(xq.T, dyq2).astype(jnp.float32) * sx.T * sdy2
    return dx.astype(x2.dtype), dw.astype(w.dtype)


int8_matmul.defvjp(_int8_fwd, _int8_bwd)


# --- fp8 -------------------------------------------------------------------------------------


def _scale(history: jax.Array, fmax: float) -> jax.Array:
    """Delayed scaling: the largest recent amax maps to the format's max (1 before any)."""
    amax = jnp.max(history)
    return jnp.where(amax > 0, amax / fmax, 1.0).astype(jnp.float32)


def _fp8(x: jax.Array, scale: jax.Array, dtype, fmax: float) -> jax.Array:
    """`x / scale` in the fp8 `dtype`, saturating at its largest finite value."""
    return jnp.clip(x.astype(jnp.float32) / scale, -fmax, fmax).astype(dtype)


def _fp8_dot(a: jax.Array, b: jax.Array, scale: jax.Array, dtype) -> jax.Array:
    """[m, k] x [k, n] fp8 operands (a cuBLASLt fp8 GEMM on Hopper and later), rescaled.

    The operands are fp8 arrays, not a quantize-dequantize round trip: XLA:GPU's
    excess-precision simplification erases such round trips inside a model."""
    out = jax.lax.dot_general(a, b, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)
    return (out * scale).astype(dtype)


def _rolled(history: jax.Array, amax: jax.Array) -> jax.Array:
    return jnp.roll(history, 1).at[0].set(amax.astype(history.dtype))


@jax.custom_vjp
def fp8_matmul(x2, w, x_history, w_history, dy_history):
    """[tokens, in] @ [in, out] with x and w in e4m3 (scales from their amax histories).

    The gradient of the output is e5m2, scaled from `dy_history`; the cotangent returned
    for `dy_history` is that history rolled with this step's gradient amax (the layer's
    parameter takes it as its new value, `ParameterSpec.update == "gradient"`).
    """
    return _fp8_fwd(x2, w, x_history, w_history, dy_history)[0]


def _fp8_fwd(x2, w, x_history, w_history, dy_history):
    sx, sw = _scale(x_history, _E4M3_MAX), _scale(w_history, _E4M3_MAX)
    qx, qw = _fp8(x2, sx, _E4M3, _E4M3_MAX), _fp8(w, sw, _E4M3, _E4M3_MAX)
    y = _fp8_dot(qx, qw, sx * sw, x2.dtype)
    # The backward pass keeps fp8 operands (a byte per element); zero-size arrays carry
    # the inputs' dtypes for the gradients.
    dtypes = (jnp.zeros((0,), x2.dtype), jnp.zeros((0,), w.dtype))
    return y, (qx, qw, sx, sw, dtypes, x_history, w_history, dy_history)


def _fp8_bwd(residuals, dy):
    qx, qw, sx, sw, (x_like, w_like), x_history, w_history, dy_history = residuals
    sdy = _scale(dy_history, _E5M2_MAX)
    qdy = _fp8(dy, sdy, _E5M2, _E5M2_MAX)
    dx = _fp8_dot(qdy, qw.T, sdy * sw, x_like.dtype)
    dw = _fp8_dot(qx.T, qdy, sx * sdy, w_like.dtype)
    new_dy_history = _rolled(dy_history, jnp.max(jnp.abs(dy)).astype(jnp.float32))
    return dx, dw, jnp.zeros_like(x_history), jnp.zeros_like(w_history), new_dy_history


fp8_matmul.defvjp(_fp8_fwd, _fp8_bwd)


# --- the layer -------------------------------------------------------------------------------


class QuantizedLinear(Linear):
    """A Linear whose matmul is int8 or fp8 (delayed, tensorwise, rowwise or MXFP8 scaling)
    in training and inference alike (an adapter on it, axplug-lora's, stays in float:
    QLoRA-style training of a quantized base).

    Parameters and optimizer state keep their dtype; only the matmul's operands are
    quantized. fp8 adds three float32 amax histories (non-trainable: the forward records the
    inputs' and weights' amax as state updates, the backward the gradients' amax).
    """

    @config_class
    class Config(Linear.Config):
        mode: str = "int8"
        int8_backward: bool = True  # int8 gradient matmuls; False: float32
        amax_history_length: int = 16  # fp8

    def __init__(self, cfg: Config, *, parent=None):
        super().__init__(cfg, parent=parent)
        if cfg.mode not in QUANTIZE_MODES:
            raise ConfigError(
                f"{self.path}.mode: unknown mode {cfg.mode!r}; choose from {list(QUANTIZE_MODES)}"
            )

    def _create_layer_parameter_specs(self) -> dict[str, ParameterSpec]:
        cfg = self._config
        specs = super()._create_layer_parameter_specs()
        if cfg.mode == "fp8":
            for name, update in (("x", "state"), ("w", "state"), ("dy", "gradient")):
                specs[f"{name}_amax_history"] = ParameterSpec(
                    shape=(cfg.amax_history_length,),
                    dtype=jnp.float32,
                    mesh_axes=(None,),
                    initializer=jax.nn.initializers.zeros,
                    weight_decay_scale=0.0,
                    update=update,
                )
        return specs

    def project(self, x: jax.Array) -> jax.Array:
        cfg = self._config
        params = self.parameters
        x = self.cast(x)
        w = self.cast(params["weight"])
        x2 = x.reshape(-1, x.shape[-1])
        if cfg.mode == "int8":
            y = int8_matmul(x2, w, cfg.int8_backward)
        elif cfg.mode in CURRENT_RECIPES:
            check_shapes(cfg.mode, x2, w, self.path)
            y = recipe_matmul(x2, w, cfg.mode)
        else:
            y = fp8_matmul(
                x2,
                w,
                params["x_amax_history"],
                params["w_amax_history"],
                params["dy_amax_history"],
            )
            if self.is_training:  # this step's amax, for the next steps' scales
                for name, value in (("x", x), ("w", w)):
                    amax = jax.lax.stop_gradient(jnp.max(jnp.abs(value)))
                    history = f"{name}_amax_history"
                    self.add_state_update(history, _rolled(params[history], amax))
        y = self.cast(y).reshape(*x.shape[:-1], y.shape[-1])
        if "bias" in params:
            y = y + self.cast(params["bias"])
        return y
