"""Current-scaling fp8 recipes (tensorwise, rowwise, MXFP8) against a float64 emulation of
their quantization: the casts bit for bit, the products within 1e-6; the layer and modifier."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from axplug_quantize.recipes import mx_quantize, recipe_matmul, scaled_quantize

from axplug.api.config import ConfigError

E4M3, E5M2 = ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e5m2
MAX = {E4M3: 448.0, E5M2: 57344.0}


def wide(rng, *shape):
    """Values over many binades, some exactly zero rows: where scaling and casts can go wrong."""
    x = rng.normal(size=shape) * np.exp2(rng.integers(-20, 20, size=shape))
    x[0] = 0.0
    # Tiny values (normal floats; XLA:CPU flushes subnormals): the smallest scales.
    x[1] = np.sign(x[1]) * np.clip(np.abs(rng.normal(size=x[1].shape)), 0.1, 3) * 1e-36
    return x.astype(np.float32)


def ref_quantize(x, dtype, axis=None):
    """float64: the power-of-two scale of each slice's amax, and x / scale cast once."""
    x = x.astype(np.float64)
    amax = np.max(np.abs(x), axis=axis, keepdims=axis is not None)
    scale = np.exp2(
        np.clip(np.ceil(np.log2(np.where(amax > 0, amax / MAX[dtype], 1.0))), -126, 127)
    )
    return np.clip(x / scale, -MAX[dtype], MAX[dtype]).astype(dtype), scale


def ref_mx(x):
    """float64 MX: 32-element blocks along the last axis, each scale the smallest power of two
    keeping the block's amax within 448 (a block of zeros: 1)."""
    b = x.astype(np.float64).reshape(*x.shape[:-1], -1, 32)
    q, scale = ref_quantize(b, E4M3, axis=-1)
    return q.reshape(x.shape), scale[..., 0]


def deq(q, scale):
    return q.astype(np.float64) * scale


def ref_mx_dot(a, b_t):
    qa, sa = ref_mx(a)
    qb, sb = ref_mx(b_t)
    return (
        np.repeat(sa, 32, -1)
        * qa.astype(np.float64)
        @ (np.repeat(sb, 32, -1) * qb.astype(np.float64)).T
    )


def ref_recipe(recipe, x, w, dy):
    """(y, dx, dw) in float64 of the dequantized operands each matmul quantizes."""
    if recipe == "fp8_tensorwise":
        (qx, sx), (qw, sw), (qd, sd) = (ref_quantize(x, E4M3), ref_quantize(w, E4M3),
                                        ref_quantize(dy, E5M2))  # fmt: skip
        X, W, D = deq(qx, sx), deq(qw, sw), deq(qd, sd)
        return X @ W, D @ W.T, X.T @ D
    if recipe == "fp8_rowwise":
        y = deq(*ref_quantize(x, E4M3, 1)) @ deq(*ref_quantize(w, E4M3, 0))
        dx = deq(*ref_quantize(dy, E4M3, 1)) @ deq(*ref_quantize(w, E4M3, 1)).T
        dw = deq(*ref_quantize(x, E4M3, 0)).T @ deq(*ref_quantize(dy, E4M3, 0))
        return y, dx, dw
    return ref_mx_dot(x, w.T), ref_mx_dot(dy, w), ref_mx_dot(x.T, dy.T)


@pytest.mark.parametrize("dtype, axis", [(E4M3, None), (E5M2, None), (E4M3, 0), (E4M3, 1)])
def test_scaled_casts_equal_the_float64_emulation_bit_for_bit(dtype, axis):
    x = wide(np.random.default_rng(0), 64, 96)
    q, scale = jax.jit(scaled_quantize, static_argnums=(1, 2))(x, jnp.dtype(dtype), axis)
    want_q, want_scale = ref_quantize(x, dtype, axis)
    np.testing.assert_array_equal(np.asarray(q).view(np.uint8), want_q.view(np.uint8))
    np.testing.assert_array_equal(np.asarray(scale, np.float64), want_scale)


def test_mx_casts_and_e8m0_scales_equal_the_float64_emulation_bit_for_bit():
    x = wide(np.random.default_rng(1), 48, 128)
    x[3, 32:64] = 0.0  # a zero block: the smallest scale, zeros
    x[5, :32] = 448.0 * 256.0  # a block exactly at a power of two times e4m3's max
    x[6, 64:96] *= 1e-30  # tiny blocks: scales near float32's smallest normal
    q, scale = jax.jit(mx_quantize)(x)
    want_q, want_scale = ref_mx(x)
    assert scale.dtype == jnp.float8_e8m0fnu and scale.shape == (48, 4)
    np.testing.assert_array_equal(np.asarray(q).view(np.uint8), want_q.view(np.uint8))
    np.testing.assert_array_equal(np.asarray(scale, np.float64), want_scale)


@pytest.mark.parametrize("recipe", ["fp8_tensorwise", "fp8_rowwise", "mxfp8"])
def test_products_and_gradients_equal_the_float64_emulation(recipe):
    rng = np.random.default_rng(2)
    x, w, dy = (rng.normal(size=s).astype(np.float32) for s in ((64, 96), (96, 128), (64, 128)))

    @jax.jit
    def forward_and_back(x, w, dy):
        y, vjp = jax.vjp(lambda a, b: recipe_matmul(a, b, recipe), x, w)
        return (y, *vjp(dy))

    y, dx, dw = forward_and_back(x, w, dy)
    for got, want in zip((y, dx, dw), ref_recipe(recipe, x, w, dy), strict=True):
        scale = np.max(np.abs(want))
        np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=1e-6, atol=1e-6 * scale)
    exact = np.asarray(x, np.float64) @ w
    assert np.max(np.abs(np.asarray(y) - exact)) > 1e-4 * np.max(np.abs(exact))  # quantized


def test_mxfp8_refuses_a_contraction_it_cannot_block():
    from axplug_quantize import QuantizedLinear

    from axplug.api.layers import functional

    layer = QuantizedLinear.default_config().set(input_dim=48, output_dim=64, mode="mxfp8")
    layer = layer.instantiate(parent=None)
    params = layer.initialize_parameters_recursively(jax.random.PRNGKey(0))
    with pytest.raises(ConfigError, match="the input width 48 is not a multiple of it"):
        functional(layer, prng_key=None, state=params, inputs=(jnp.ones((32, 48)),),
                   is_training=False)  # fmt: skip
