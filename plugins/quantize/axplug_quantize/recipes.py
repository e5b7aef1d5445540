"""Current-scaling fp8 recipes: scales from the tensors being multiplied, this step's.

- `fp8_tensorwise`: one scale per tensor; inputs and weights e4m3, output gradients e5m2.
- `fp8_rowwise`: a scale per row of each matmul's operands along its contraction (per token
  and per output channel forward; per token x per input channel and per channel over the
  tokens for the gradients), every operand e4m3.
- `mxfp8` (OCP Microscaling): blocks of 32 consecutive elements along each matmul's
  contraction share an e8m0 scale, the smallest power of two that keeps the block's amax
  within e4m3's 448 (NVIDIA's rounding-up rule: the OCP spec's 2^(floor(log2 amax) - 8)
  clips the top binade's values to 448, up to 12.5% off); 1 for a block of zeros; exponents
  in float32's normal range, -126..127; every operand
  e4m3, saturating. The matmul is `jax.nn.scaled_matmul` (cuDNN's block-scaled GEMM) on
  Blackwell, its exact definition elsewhere (each block rescaled, one float32 dot).

Tensorwise and rowwise scales are powers of two too (2^ceil(log2(amax / max))), so every
scaling is exact and only the casts round. Gradient matmuls re-quantize their operands
along their own contraction (x and the gradient over the tokens for dw), as the recipes do.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from axplug.api.config import ConfigError

__all__ = [
    "CURRENT_RECIPES",
    "MX_BLOCK",
    "block_scaled_gemm",
    "mx_quantize",
    "recipe_matmul",
    "scaled_quantize",
]

CURRENT_RECIPES = ("fp8_tensorwise", "fp8_rowwise", "mxfp8")
MX_BLOCK = 32
_E4M3, _E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2
# Scale exponents stay where float32 is normal: a subnormal scale would flush to zero.
_MIN_EXP, _MAX_EXP = -126, 127


def _max(dtype) -> float:
    return float(jnp.finfo(dtype).max)


def scaled_quantize(x: jax.Array, dtype, axis=None) -> tuple[jax.Array, jax.Array]:
    """(x / scale in `dtype`, scale float32): one power-of-two scale per slice along `axis`
    (None: the whole tensor), the smallest that keeps the slice's amax in range."""
    x, fmax = x.astype(jnp.float32), _max(dtype)
    amax = jnp.max(jnp.abs(x), axis=axis, keepdims=axis is not None)
    scale = _power_of_two(jnp.where(amax > 0, amax / fmax, 1.0))
    return jnp.clip(x / scale, -fmax, fmax).astype(dtype), scale


def _power_of_two(ratio: jax.Array) -> jax.Array:
    """The smallest power of two >= `ratio` (float32-normal exponents), built from its bits:
    `exp2` is not exact on every backend (XLA:CPU: 2^-126 comes out 0, most others off by
    an ulp)."""
    exponent = jnp.clip(jnp.ceil(jnp.log2(ratio)), _MIN_EXP, _MAX_EXP).astype(jnp.int32)
    # log2 rounds: a ratio next to a power of two can land one exponent off either way.
    exponent = exponent + (_exact_pow2(exponent) < ratio)
    lower = jnp.maximum(exponent - 1, _MIN_EXP)
    exponent = jnp.where((exponent > _MIN_EXP) & (_exact_pow2(lower) >= ratio), lower, exponent)
    return _exact_pow2(jnp.minimum(exponent, _MAX_EXP))


def _exact_pow2(exponent: jax.Array) -> jax.Array:
    """2^exponent in float32, exactly, for exponents in [-126, 127]."""
    bits = (exponent.astype(jnp.int32) + 127) << 23
    return jax.lax.bitcast_convert_type(bits, jnp.float32)


def mx_quantize(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(e4m3 elements [..., k], e8m0 scales [..., k / 32]) of `x`, blocks along the last axis."""
    x = x.astype(jnp.float32)
    blocks = x.reshape(*x.shape[:-1], x.shape[-1] // MX_BLOCK, MX_BLOCK)
    amax = jnp.max(jnp.abs(blocks), axis=-1, keepdims=True)
    fmax = _max(_E4M3)
    # A block of zeros takes scale 1 (its elements are zeros whatever the scale).
    scale = _power_of_two(jnp.where(amax > 0, amax / fmax, 1.0))
    q = jnp.clip(blocks / scale, -fmax, fmax).astype(_E4M3)
    return q.reshape(x.shape), scale[..., 0].astype(jnp.float8_e8m0fnu)


def _dot(a, b):
    return jax.lax.dot_general(a, b, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)


def block_scaled_gemm() -> bool:
    """Whether this machine has a block-scaled MXFP8 GEMM (cuDNN on Blackwell, compute
    capability 10+): `jax.nn.scaled_matmul` lowers there and nowhere else."""
    if jax.default_backend() != "gpu":
        return False
    try:
        return float(jax.devices()[0].compute_capability) >= 10.0
    except (AttributeError, ValueError):
        return False


def _mx_dot(a: jax.Array, b_t: jax.Array) -> jax.Array:
    """[m, k] x [n, k]^T with both quantized to MXFP8 along k: float32 [m, n]."""
    qa, sa = mx_quantize(a)
    qb, sb = mx_quantize(b_t)
    if block_scaled_gemm():
        return jax.nn.scaled_matmul(qa[None], qb[None], sa[None], sb[None])[0]

    # scaled_matmul's definition: each element times its block's scale (exact in float32:
    # an e4m3 value times a power of two), then one float32 dot.
    def scaled(q, s):
        return q.astype(jnp.float32) * jnp.repeat(s.astype(jnp.float32), MX_BLOCK, axis=-1)

    return _dot(scaled(qa, sa), scaled(qb, sb).T)


def _tensorwise(x2, w, dy=None):
    qx, sx = scaled_quantize(x2, _E4M3)
    qw, sw = scaled_quantize(w, _E4M3)
    if dy is None:
        return _dot(qx, qw) * (sx * sw)
    qdy, sdy = scaled_quantize(dy, _E5M2)
    return _dot(qdy, qw.T) * (sdy * sw), _dot(qx.T, qdy) * (sx * sdy)


def _rowwise(x2, w, dy=None):
    if dy is None:
        qx, sx = scaled_quantize(x2, _E4M3, axis=1)  # per token
        qw, sw = scaled_quantize(w, _E4M3, axis=0)  # per output channel
        return _dot(qx, qw) * sx * sw
    qdy, sdy = scaled_quantize(dy, _E4M3, axis=1)  # dx = dy w^T: per token, over out
    qw, sw = scaled_quantize(w, _E4M3, axis=1)  # per input channel, over out
    dx = _dot(qdy, qw.T) * sdy * sw.T
    qx, sx = scaled_quantize(x2, _E4M3, axis=0)  # dw = x^T dy: per input channel, over tokens
    qdy2, sdy2 = scaled_quantize(dy, _E4M3, axis=0)  # per output channel, over tokens
    return dx, _dot(qx.T, qdy2) * sx.T * sdy2


def _mxfp8(x2, w, dy=None):
    if dy is None:
        return _mx_dot(x2, w.T)
    return _mx_dot(dy, w), _mx_dot(x2.T, dy.T)  # dx over out, dw over the tokens


_RECIPES = {"fp8_tensorwise": _tensorwise, "fp8_rowwise": _rowwise, "mxfp8": _mxfp8}


def check_shapes(recipe: str, x2: jax.Array, w: jax.Array, path: str) -> None:
    """MXFP8 blocks every contraction by 32: the tokens and both widths."""
    if recipe == "mxfp8":
        dims = {"tokens": x2.shape[0], "input width": w.shape[0], "output width": w.shape[1]}
        bad = {k: v for k, v in dims.items() if v % MX_BLOCK}
        if bad:
            raise ConfigError(
                f"{path}: mxfp8 quantizes blocks of {MX_BLOCK} along every matmul's "
                f"contraction, and {', '.join(f'the {k} {v}' for k, v in bad.items())} "
                f"{'is' if len(bad) == 1 else 'are'} not a multiple of it; use fp8_rowwise"
            )


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def recipe_matmul(x2: jax.Array, w: jax.Array, recipe: str) -> jax.Array:
    """[tokens, in] @ [in, out] by a current-scaling fp8 `recipe` (float32 out); its
    gradients by the recipe's quantized matmuls."""
    return _RECIPES[recipe](x2, w)


def _fwd(x2, w, recipe):
    return _RECIPES[recipe](x2, w), (x2, w)


def _bwd(recipe, residuals, dy):
    x2, w = residuals
    dx, dw = _RECIPES[recipe](x2, w, dy.astype(jnp.float32))
    return dx.astype(x2.dtype), dw.astype(w.dtype)


recipe_matmul.defvjp(_fwd, _bwd)
