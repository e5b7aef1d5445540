"""Numerics of the core layers against plain-numpy (float64) references written in this file.

Tolerance policy:
- float32 paths: rtol = atol = 1e-5 (F32), loosened to 1e-4 only where a long chain of
  matmuls/softmaxes is compared (whole decoders, gradients): XLA may fuse or reorder sums.
- bfloat16 compute: rtol = atol = 2e-2 (BF16) against the float32 result (atol scaled by the
  magnitude for logits); bf16 has an 8-bit mantissa (relative rounding 2^-9 per op), a few
  ops compound to ~1e-2. A single rounding of a float32 result (norms) gets rtol 2^-8.
- Structural checks (shapes, dtypes, PRNG-per-name stability, determinism) are exact.

References use the parameters the layers initialize (norm scales and biases, initialized to
ones/zeros, are replaced by random values of the same shape so that they matter); the
reference math never calls the layers' own helpers (AttentionMask.dense, ACTIVATIONS,
cross_entropy...). Inputs come from numpy RNGs: each new shape drawn with jax.random costs a
compile (~0.5 s on CPU); the references run in numpy for the same reason (an eager jnp op
compiles a program per new shape), except where a test needs the layer's own float32
roundings (bf16 results compared value for value).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from axplug.api import AttentionMask, ParameterSpec
from axplug.config import ConfigError
from axplug.context import ContextError, functional
from axplug.layers import (
    Attention,
    CausalLM,
    Decoder,
    DotProductKernel,
    Embedding,
    FeedForward,
    LayerNorm,
    Linear,
    QKVLinear,
    RepeatedTransformer,
    RMSNorm,
    StackedTransformer,
    TransformerLayer,
    cross_entropy,
)

F32 = dict(rtol=1e-5, atol=1e-5)
F32_LOOSE = dict(rtol=1e-4, atol=1e-4)
BF16 = dict(rtol=2e-2, atol=2e-2)

B, S, D, H, F, V = 2, 6, 8, 2, 16, 11  # batch, seq, model dim, heads, hidden, vocab
LOGICAL_AXES = {"embed", "mlp", "heads", "kv", "vocab", "expert", "layers", None}


# ----------------------------------------------------------------------------- helpers


def key(i: int) -> jax.Array:
    return jax.random.PRNGKey(i)


def normal(i: int, shape, dtype=jnp.float32) -> jax.Array:
    # numpy, not jax.random: every new shape would cost a jax.random compile (~0.5 s on CPU).
    return jnp.asarray(np.random.default_rng(i).standard_normal(shape), dtype)


def host(tree):
    """`tree`'s arrays as numpy, floats as float64: the reference math runs in numpy (an eager
    jnp op compiles a program per new shape; numpy compiles nothing)."""

    def leaf(a):
        if not isinstance(a, (jax.Array, np.ndarray)):
            return a
        a = np.asarray(a)
        return a.astype(np.float64) if jnp.issubdtype(a.dtype, jnp.floating) else a

    return jax.tree.map(leaf, tree)


def on_host(fn):
    """`fn` with its arguments moved to numpy by `host`."""

    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        return fn(*host(args), **host(kwargs))

    return wrapped


def build(cls, **kwargs):
    return cls.default_config().set(**kwargs).instantiate(parent=None)


def init(m, seed: int = 0, randomize_norms: bool = True):
    """The layer's own initialized parameters; ones/zeros leaves (scale, bias) made random."""
    params = m.initialize_parameters_recursively(key(seed))
    if not randomize_norms:
        return params
    leaves, treedef = jax.tree_util.tree_flatten_with_path(params)
    out = []
    for i, (path, leaf) in enumerate(leaves):
        name = path[-1].key
        if name == "scale":  # drawn and shifted in numpy: no op compiled per shape
            leaf = jnp.asarray(1.0 + 0.5 * host(normal(1000 + i, leaf.shape)), leaf.dtype)
        elif name == "bias":
            leaf = jnp.asarray(0.5 * host(normal(2000 + i, leaf.shape)), leaf.dtype)
        out.append(leaf)
    return jax.tree_util.tree_unflatten(treedef, out)


def run(m, params, inputs, *, prng_key=None, training=False, method="forward"):
    out, _ = functional(
        m, prng_key=prng_key, state=params, inputs=inputs, is_training=training, method=method
    )
    return out


def layer_cfg(dropout_rate: float = 0.0, **ffn):
    cfg = TransformerLayer.default_config().set(dropout_rate=dropout_rate)
    cfg.attention.set(num_heads=H)
    cfg.feed_forward.set(hidden_dim=F, **ffn)
    return cfg


def arange_positions(b: int = B, s: int = S) -> np.ndarray:
    return np.broadcast_to(np.arange(s, dtype=np.int32), (b, s))


def assert_close(actual, desired, tol=F32):
    np.testing.assert_allclose(
        np.asarray(actual, dtype=np.float32), np.asarray(desired, dtype=np.float32), **tol
    )


def assert_trees_equal(a, b):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


# --------------------------------------------------- reference math (plain numpy, float64)


@on_host
def ref_linear(x, p):
    y = x @ p["weight"]
    return y + p["bias"] if "bias" in p else y


@on_host
def ref_rms_norm(x, p, eps=1e-6):
    return x / np.sqrt(np.mean(x**2, axis=-1, keepdims=True) + eps) * p["scale"]


@on_host
def ref_layer_norm(x, p, eps=1e-5):
    mu = x.mean(-1, keepdims=True)
    var = ((x - mu) ** 2).mean(-1, keepdims=True)
    y = (x - mu) / np.sqrt(var + eps) * p["scale"]
    return y + p["bias"] if "bias" in p else y


@on_host
def ref_silu(x):
    return x / (1.0 + np.exp(-x))


@on_host
def ref_gelu_tanh(x):
    return 0.5 * x * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x**3)))


@on_host
def ref_gelu_erf(x):
    erf = np.vectorize(math.erf)(x / math.sqrt(2.0))
    return 0.5 * x * (1.0 + erf)


@on_host
def ref_ffn(x, p, act=ref_silu, gated=True):
    up = x @ p["wi_up"]["weight"]
    h = act(x @ p["wi_gate"]["weight"]) * up if gated else act(up)
    return h @ p["wo"]["weight"]


@on_host
def ref_softmax(logits):
    e = np.exp(logits - logits.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def ref_mask(b, s, *, causal=True, window=None, segment_ids=None):
    """Boolean [b, q, k] by index: causal j <= i, window i - j < w, equal segments."""
    m = np.ones((b, s, s), dtype=bool)
    seg = None if segment_ids is None else np.asarray(segment_ids)
    for bi in range(b):
        for i in range(s):
            for j in range(s):
                if causal and j > i:
                    m[bi, i, j] = False
                if window is not None and i - j >= window:
                    m[bi, i, j] = False
                if seg is not None and seg[bi, i] != seg[bi, j]:
                    m[bi, i, j] = False
    return m


@on_host
def ref_sdpa(q, k, v, mask):
    """q, k, v [b, s, h, d] (same heads); mask [b, q, k] -> [b, q, h, d]."""
    logits = np.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(q.shape[-1])
    logits = np.where(mask[:, None], logits, -np.inf)
    return np.einsum("bhqk,bkhd->bqhd", ref_softmax(logits), v)


@on_host
def ref_attention(x, p, num_heads, mask):
    b, s, _ = x.shape
    split = lambda t: t.reshape(b, s, num_heads, -1)
    q = split(x @ p["qkv"]["q"]["weight"])
    k = split(x @ p["qkv"]["k"]["weight"])
    v = split(x @ p["qkv"]["v"]["weight"])
    o = ref_sdpa(q, k, v, mask).reshape(b, s, -1)
    return o @ p["output"]["weight"]


@on_host
def ref_transformer_layer(x, p, mask, num_heads=H):
    x = x + ref_attention(ref_rms_norm(x, p["attention_norm"]), p["attention"], num_heads, mask)
    return x + ref_ffn(ref_rms_norm(x, p["feed_forward_norm"]), p["feed_forward"])


@on_host
def ref_decoder(ids, p, num_layers, mask, tied=False):
    x = p["embedding"]["weight"][ids]
    for i in range(num_layers):
        x = ref_transformer_layer(x, p["transformer"][f"layer{i}"], mask)
    x = ref_rms_norm(x, p["output_norm"])
    if tied:
        return x @ p["embedding"]["weight"].T
    return x @ p["lm_head"]["weight"]


@on_host
def ref_xent(logits, labels):
    shifted = logits - logits.max(-1, keepdims=True)
    logp = shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))
    total, count = 0.0, 0
    for idx in np.ndindex(labels.shape):
        if labels[idx] >= 0:
            total += -float(logp[idx + (int(labels[idx]),)])
            count += 1
    return total / max(count, 1), count


# ------------------------------------------------------------------------ basic layers


@pytest.mark.parametrize("bias", [False, True])
def test_linear(bias):
    m = build(Linear, input_dim=D, output_dim=F, bias=bias)
    params = init(m)
    assert set(params) == ({"weight", "bias"} if bias else {"weight"})
    assert params["weight"].shape == (D, F)
    x = normal(1, (B, S, D))
    out = run(m, params, (x,))
    assert out.shape == (B, S, F) and out.dtype == jnp.float32
    assert_close(out, ref_linear(x, params))


def test_embedding_forward_and_attend():
    m = build(Embedding, num_embeddings=V, dim=D)
    params = init(m)
    table = params["weight"]
    assert table.shape == (V, D)
    ids = np.array([[0, 3, 10, 3], [7, 1, 2, 9]], np.int32)
    out = run(m, params, (ids,))
    assert out.shape == (2, 4, D)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(table)[np.asarray(ids)])
    x = normal(1, (B, S, D))
    logits = run(m, params, (x,), method="attend")
    assert logits.shape == (B, S, V)
    assert_close(logits, np.einsum("bsd,vd->bsv", host(x), host(table)))


def test_rms_norm():
    m = build(RMSNorm, input_dim=D)
    params = init(m)
    x = 3.0 * normal(1, (B, S, D)) + 0.5
    assert_close(run(m, params, (x,)), ref_rms_norm(x, params))
    m2 = build(RMSNorm, input_dim=D, eps=0.5)
    assert_close(run(m2, params, (x,)), ref_rms_norm(x, params, eps=0.5))


def test_rms_norm_scale_offset_is_gemmas_one_plus_w():
    m = build(RMSNorm, input_dim=D, scale_offset=1.0)
    # The stored scale starts at zeros: the effective scale (1 + w) starts at one.
    np.testing.assert_array_equal(init(m, randomize_norms=False)["scale"], np.zeros(D))
    x = 3.0 * normal(1, (B, S, D)) + 0.5
    w = 0.5 * normal(2, (D,))
    xh, wh = host(x), host(w)
    want = xh / np.sqrt(np.mean(xh**2, axis=-1, keepdims=True) + 1e-6) * (1.0 + wh)
    assert_close(run(m, {"scale": w}, (x,)), want)
    # Any offset starts as the identity scale and adds itself to the stored one.
    half = build(RMSNorm, input_dim=D, scale_offset=0.5)
    np.testing.assert_array_equal(init(half, randomize_norms=False)["scale"], np.full(D, 0.5))
    assert_close(run(half, {"scale": w}, (x,)), ref_rms_norm(x, {"scale": wh + 0.5}))
    # The default stays x / rms(x) * w with ones at init.
    np.testing.assert_array_equal(
        init(build(RMSNorm, input_dim=D), randomize_norms=False)["scale"], np.ones(D)
    )
    # bf16 compute: Gemma's float32 math of the bf16 input, cast once at the end.
    m16 = build(RMSNorm, input_dim=D, scale_offset=1.0, compute_dtype="bfloat16")
    x16 = x.astype(jnp.bfloat16)
    x32 = x16.astype(jnp.float32)
    want16 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, -1, keepdims=True) + 1e-6) * (1.0 + w)
    out16 = run(m16, {"scale": w}, (x16,))
    assert out16.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(out16), np.asarray(want16.astype(jnp.bfloat16)))


@pytest.mark.parametrize("bias", [False, True])
def test_layer_norm(bias):
    m = build(LayerNorm, input_dim=D, bias=bias)
    params = init(m)
    assert set(params) == ({"scale", "bias"} if bias else {"scale"})
    x = 3.0 * normal(1, (B, S, D)) + 0.5
    out = run(m, params, (x,))
    assert_close(out, ref_layer_norm(x, params))


@pytest.mark.parametrize(
    "activation,gated,ref_act",
    [
        ("silu", True, ref_silu),
        ("gelu", False, ref_gelu_tanh),
        ("gelu", True, ref_gelu_tanh),
        ("gelu_tanh", True, ref_gelu_tanh),  # GeGLU with the tanh GELU (Gemma)
        ("gelu_exact", True, ref_gelu_erf),
    ],
)
def test_feed_forward(activation, gated, ref_act):
    m = build(FeedForward, input_dim=D, hidden_dim=F, activation=activation, gated=gated)
    params = init(m)
    assert set(params) == ({"wi_gate", "wi_up", "wo"} if gated else {"wi_up", "wo"})
    assert params["wo"]["weight"].shape == (F, D)
    x = normal(1, (B, S, D))
    assert_close(run(m, params, (x,)), ref_ffn(x, params, ref_act, gated))


def test_hugging_face_activation_names_map_to_the_same_functions():
    from axplug.layers import ACTIVATIONS, HF_ACTIVATIONS

    x = 3.0 * normal(1, (64,))
    refs = {
        "gelu": ref_gelu_erf,  # exact in Hugging Face
        "gelu_pytorch_tanh": ref_gelu_tanh,
        "gelu_new": ref_gelu_tanh,
        "silu": ref_silu,
        "swish": ref_silu,
    }
    for hf_name, ref in refs.items():
        assert_close(ACTIVATIONS[HF_ACTIVATIONS[hf_name]](x), ref(x))
    assert set(HF_ACTIVATIONS.values()) <= set(ACTIVATIONS)


def test_unknown_activation_error_names_path():
    with pytest.raises(ConfigError, match=r"model\.activation: unknown activation 'swish2'"):
        build(FeedForward, input_dim=D, hidden_dim=F, activation="swish2")
    cfg = TransformerLayer.default_config().set(input_dim=D)
    cfg.attention.set(num_heads=H)
    cfg.feed_forward.set(hidden_dim=F, activation="nope")
    with pytest.raises(ConfigError, match=r"model\.feed_forward\.activation.*'nope'.*silu"):
        cfg.instantiate(parent=None)


# --------------------------------------------------------------------------- attention


def build_attention(**kwargs):
    return build(Attention, input_dim=D, num_heads=H, **kwargs)


def test_attention_causal_default():
    m = build_attention()
    params = init(m)
    assert params["qkv"]["q"]["weight"].shape == (D, D)
    assert params["output"]["weight"].shape == (D, D)
    x = normal(1, (B, S, D))
    out = run(m, params, {"x": x, "positions": arange_positions()})
    assert out.shape == (B, S, D) and out.dtype == jnp.float32
    assert_close(out, ref_attention(x, params, H, ref_mask(B, S)))
    # Causality: changing the last token leaves earlier outputs untouched.
    x2 = np.array(x)
    x2[:, -1] = np.asarray(normal(2, (B, D)))
    out2 = run(m, params, {"x": x2, "positions": arange_positions()})
    out, out2 = np.asarray(out), np.asarray(out2)  # sliced in numpy: no op compiled per slice
    assert_close(out2[:, :-1], out[:, :-1])
    assert not np.allclose(out2[:, -1], out[:, -1])


def test_attention_head_dim_override():
    m = build_attention(head_dim=3)
    params = init(m)
    assert params["qkv"]["k"]["weight"].shape == (D, H * 3)
    assert params["output"]["weight"].shape == (H * 3, D)
    x = normal(1, (B, S, D))
    out = run(m, params, {"x": x, "positions": arange_positions()})
    assert_close(out, ref_attention(x, params, H, ref_mask(B, S)))


def test_attention_qkv_bias_is_on_q_k_v_only():
    m = build(Attention, input_dim=D, num_heads=H, qkv=QKVLinear.default_config().set(bias=True))
    params = init(m)
    for name in "qkv":
        assert params["qkv"][name]["bias"].shape == (D,)
    assert set(params["output"]) == {"weight"}  # the output projection stays bias-free
    x = normal(1, (B, S, D))
    out = run(m, params, {"x": x, "positions": arange_positions()})
    split = lambda t: t.reshape(B, S, H, -1)  # noqa: E731
    q, k, v = (split(ref_linear(x, params["qkv"][n])) for n in "qkv")
    want = ref_sdpa(q, k, v, ref_mask(B, S)).reshape(B, S, -1) @ host(params["output"]["weight"])
    assert_close(out, want)
    # The default has no biases: the same parameter tree as before the option existed.
    assert set(init(build_attention())["qkv"]["q"]) == {"weight"}


@pytest.mark.parametrize("over", ["head_dim", "projection"])
def test_attention_qk_norm(over):
    hd = 3  # head_dim != D // H, so the two modes' norm widths differ from D
    m = build_attention(head_dim=hd, qk_norm=RMSNorm.default_config(), qk_norm_over=over)
    params = init(m)  # random norm scales
    width = hd if over == "head_dim" else H * hd
    assert params["q_norm"]["scale"].shape == params["k_norm"]["scale"].shape == (width,)
    x = normal(1, (B, S, D))
    out = run(m, params, {"x": x, "positions": arange_positions()})
    x, p = host(x), host(params["qkv"])
    split = lambda t: t.reshape(B, S, H, hd)  # noqa: E731
    if over == "head_dim":  # each head's q (and k) normed over its head_dim, one shared scale
        q = ref_rms_norm(split(x @ p["q"]["weight"]), params["q_norm"])
        k = ref_rms_norm(split(x @ p["k"]["weight"]), params["k_norm"])
    else:  # the whole projection normed, then split into heads
        q = split(ref_rms_norm(x @ p["q"]["weight"], params["q_norm"]))
        k = split(ref_rms_norm(x @ p["k"]["weight"], params["k_norm"]))
    v = split(x @ p["v"]["weight"])
    want = ref_sdpa(q, k, v, ref_mask(B, S)).reshape(B, S, -1) @ host(params["output"]["weight"])
    assert_close(out, want)
    # Without qk_norm: no norm parameters, the old tree.
    assert set(init(build_attention())) == {"qkv", "output"}


def test_attention_qk_norm_errors_name_the_field():
    with pytest.raises(ConfigError, match=r"^qk_norm_over: 'heads' is not one of"):
        build_attention(qk_norm=RMSNorm.default_config(), qk_norm_over="heads")
    with pytest.raises(ConfigError, match=r"^qk_norm: DotProductKernel.Config has no input_dim"):
        build_attention(qk_norm=DotProductKernel.default_config())
    cfg = layer_cfg().set(input_dim=D)
    cfg.attention.set(qk_norm=RMSNorm.default_config(), qk_norm_over="all")
    with pytest.raises(ConfigError, match=r"^attention\.qk_norm_over: 'all' is not one of"):
        cfg.instantiate(parent=None)


def test_attention_logit_softcap():
    cap = 0.5  # below the scores' scale, so the cap bends them
    m = build_attention(logit_softcap=cap)
    params = init(m)
    x = 2.0 * normal(1, (B, S, D))
    out = run(m, params, {"x": x, "positions": arange_positions()})
    split = lambda t: t.reshape(B, S, H, -1)  # noqa: E731
    hp, wo = host(params), host(params["output"]["weight"])
    q, k, v = (split(host(x) @ hp["qkv"][n]["weight"]) for n in "qkv")
    scores = np.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(q.shape[-1])
    assert float(np.abs(scores).max()) > 2 * cap
    scores = cap * np.tanh(scores / cap)  # after the scale, before the mask
    probs = ref_softmax(np.where(ref_mask(B, S)[:, None], scores, -np.inf))
    want = np.einsum("bhqk,bkhd->bqhd", probs, v).reshape(B, S, -1) @ wo
    assert_close(out, want)
    # With a query scale of the kernel slot's (Gemma: query_pre_attn_scalar ** -0.5).
    scaled = build_attention(
        logit_softcap=cap, kernel=DotProductKernel.default_config().set(scale=0.2)
    )
    out = run(scaled, params, {"x": x, "positions": arange_positions()})
    scores = cap * np.tanh(np.einsum("bqhd,bkhd->bhqk", q, k) * 0.2 / cap)
    probs = ref_softmax(np.where(ref_mask(B, S)[:, None], scores, -np.inf))
    want = np.einsum("bhqk,bkhd->bqhd", probs, v).reshape(B, S, -1) @ wo
    assert_close(out, want)
    for bad in (0.0, -50.0, float("inf")):
        with pytest.raises(ConfigError, match=r"^logit_softcap: .* must be a finite number > 0"):
            build_attention(logit_softcap=bad)


def test_attention_non_causal():
    m = build_attention(causal=False)
    params = init(m)
    x = normal(1, (B, S, D))
    out = run(m, params, {"x": x, "positions": arange_positions()})
    assert_close(out, ref_attention(x, params, H, ref_mask(B, S, causal=False)))
    # The first token now sees the future, unlike the causal default.
    causal_out = run(build_attention(), params, {"x": x, "positions": arange_positions()})
    assert not np.allclose(np.asarray(out)[:, 0], np.asarray(causal_out)[:, 0])


def test_attention_segment_ids_packed_sequences():
    m = build_attention()
    params = init(m)
    segment_ids = np.array([[0, 0, 0, 1, 1, 1], [0, 0, 1, 1, 1, 2]], np.int32)
    # Packed sequences restart their positions at each segment.
    positions = np.array([[0, 1, 2, 0, 1, 2], [0, 1, 0, 1, 2, 0]], np.int32)
    x = normal(1, (B, S, D))
    inputs = {"x": x, "positions": positions, "segment_ids": segment_ids}
    out = run(m, params, inputs)
    assert_close(out, ref_attention(x, params, H, ref_mask(B, S, segment_ids=segment_ids)))
    # A token of row 0 segment 0 never sees segment 1, and vice versa (inputs edited and
    # outputs sliced in numpy: no op compiled per slice).
    out = np.asarray(out)
    x2 = np.array(x)
    x2[0, 3:] = np.asarray(normal(2, (S - 3, D)))
    out2 = np.asarray(run(m, params, {**inputs, "x": x2}))
    assert_close(out2[0, :3], out[0, :3])
    assert_close(out2[1], out[1])
    x3 = np.array(x)
    x3[0, :3] = np.asarray(normal(3, (3, D)))
    out3 = np.asarray(run(m, params, {**inputs, "x": x3}))
    assert_close(out3[0, 3:], out[0, 3:])
    # Each segment alone gives the same result as in the pack.
    alone = run(m, params, {"x": np.asarray(x)[:1, 3:], "positions": arange_positions(1, 3)})
    assert_close(out[0, 3:], np.asarray(alone)[0])


@pytest.mark.parametrize("window", [1, 2, 4])
def test_attention_sliding_window(window):
    m = build_attention(sliding_window=window)
    params = init(m)
    x = normal(1, (B, S, D))
    out = run(m, params, {"x": x, "positions": arange_positions()})
    assert_close(out, ref_attention(x, params, H, ref_mask(B, S, window=window)))
    if window == 1:  # each token sees only itself: out = (x Wv) Wo
        v = host(x) @ host(params["qkv"]["v"]["weight"])
        assert_close(out, v @ host(params["output"]["weight"]))


def test_attention_sliding_window_with_segments():
    m = build_attention(sliding_window=2)
    params = init(m)
    segment_ids = np.array([[0, 0, 0, 0, 1, 1], [0, 1, 1, 1, 1, 1]], np.int32)
    positions = np.array([[0, 1, 2, 3, 0, 1], [0, 0, 1, 2, 3, 4]], np.int32)
    x = normal(1, (B, S, D))
    out = run(m, params, {"x": x, "positions": positions, "segment_ids": segment_ids})
    mask = ref_mask(B, S, window=2, segment_ids=segment_ids)
    assert_close(out, ref_attention(x, params, H, mask))


@pytest.mark.parametrize("kv_heads", [1, 2, 4])
def test_dot_product_kernel_grouped_kv_heads(kv_heads):
    num_heads, d = 4, 3
    kernel = build(DotProductKernel)
    assert kernel.initialize_parameters_recursively(key(0)) == {}
    q = normal(1, (B, S, num_heads, d))
    k = normal(2, (B, S, kv_heads, d))
    v = normal(3, (B, S, kv_heads, d))
    mask = AttentionMask(q_positions=arange_positions(), kv_positions=arange_positions())
    out = run(kernel, {}, (q, k, v, mask))
    assert out.shape == (B, S, num_heads, d)
    rep = num_heads // kv_heads
    k, v = host(k), host(v)
    expected = ref_sdpa(q, np.repeat(k, rep, axis=2), np.repeat(v, rep, axis=2), ref_mask(B, S))
    assert_close(out, expected)


def test_dot_product_kernel_bad_head_ratio():
    kernel = build(DotProductKernel)
    q = normal(1, (B, S, 3, 2))
    k = normal(2, (B, S, 2, 2))
    mask = AttentionMask(q_positions=arange_positions(), kv_positions=arange_positions())
    with pytest.raises(ConfigError, match="model: 3 query heads not divisible by 2 kv heads"):
        run(kernel, {}, (q, k, k, mask))


def test_dot_product_kernel_custom_scale():
    kernel = build(DotProductKernel, scale=0.25)
    q, k, v = (normal(i, (B, S, H, 4)) for i in (1, 2, 3))
    mask = AttentionMask(
        q_positions=arange_positions(), kv_positions=arange_positions(), causal=False
    )
    out = run(kernel, {}, (q, k, v, mask))
    # ref_sdpa divides by sqrt(4) = 2; a scale of 0.25 is the same as q / 2.
    expected = ref_sdpa(host(q) / 2.0, k, v, ref_mask(B, S, causal=False))
    assert_close(out, expected)


# ------------------------------------------------------------------- transformer layer


def test_transformer_layer_pre_norm_residual():
    m = layer_cfg().set(input_dim=D).instantiate(parent=None)
    params = init(m)
    assert set(params) == {"attention_norm", "attention", "feed_forward_norm", "feed_forward"}
    x = normal(1, (B, S, D))
    out = run(m, params, {"x": x, "positions": arange_positions()})
    assert_close(out, ref_transformer_layer(x, params, ref_mask(B, S)))


@pytest.mark.parametrize("pre_norm", [True, False], ids=["pre_and_post", "post_only"])
def test_transformer_layer_post_norms(pre_norm):
    # Gemma 2/3: x + post(attn(pre(x))); OLMo 2: x + post(attn(x)). Same for the FFN.
    cfg = layer_cfg().set(input_dim=D, pre_norm=pre_norm, post_norm=True)
    m = cfg.instantiate(parent=None)
    params = init(m)
    names = {"attention", "post_attention_norm", "feed_forward", "post_feed_forward_norm"}
    assert set(params) == names | ({"attention_norm", "feed_forward_norm"} if pre_norm else set())
    pre = lambda name, x: ref_rms_norm(x, params[name]) if pre_norm else x  # noqa: E731
    x = normal(1, (B, S, D))
    out = run(m, params, {"x": x, "positions": arange_positions()})
    x = host(x)
    h = ref_attention(pre("attention_norm", x), params["attention"], H, ref_mask(B, S))
    y = x + ref_rms_norm(h, params["post_attention_norm"])
    h = ref_ffn(pre("feed_forward_norm", y), params["feed_forward"])
    want = y + ref_rms_norm(h, params["post_feed_forward_norm"])
    assert_close(out, want)


def test_transformer_layer_with_segments():
    m = layer_cfg().set(input_dim=D).instantiate(parent=None)
    params = init(m)
    segment_ids = np.array([[0, 0, 1, 1, 1, 1], [0, 0, 0, 0, 0, 1]], np.int32)
    positions = np.array([[0, 1, 0, 1, 2, 3], [0, 1, 2, 3, 4, 0]], np.int32)
    x = normal(1, (B, S, D))
    out = run(m, params, {"x": x, "positions": positions, "segment_ids": segment_ids})
    mask = ref_mask(B, S, segment_ids=segment_ids)
    assert_close(out, ref_transformer_layer(x, params, mask))


def test_transformer_layer_dropout():
    m = layer_cfg(dropout_rate=0.5).set(input_dim=D).instantiate(parent=None)
    params = init(m)
    x = normal(1, (B, S, D))
    inputs = {"x": x, "positions": arange_positions()}
    expected = ref_transformer_layer(x, params, ref_mask(B, S))

    # Not training: no dropout, with or without a key.
    assert_close(run(m, params, inputs, prng_key=None), expected)
    assert_close(run(m, params, inputs, prng_key=key(7)), expected)

    # Training: outputs change, deterministically per key.
    a = run(m, params, inputs, prng_key=key(7), training=True)
    a2 = run(m, params, inputs, prng_key=key(7), training=True)
    b = run(m, params, inputs, prng_key=key(8), training=True)
    assert not np.allclose(a, expected)
    np.testing.assert_array_equal(np.asarray(a), np.asarray(a2))
    assert not np.allclose(a, b)

    # dropout_rate 0 in training is the eval computation.
    m0 = layer_cfg(dropout_rate=0.0).set(input_dim=D).instantiate(parent=None)
    assert_close(run(m0, params, inputs, prng_key=key(7), training=True), expected)


def test_transformer_layer_dropout_needs_key_in_training():
    m = layer_cfg(dropout_rate=0.5).set(input_dim=D).instantiate(parent=None)
    params = init(m)
    with pytest.raises(ContextError, match="prng_key"):
        run(m, params, {"x": normal(1, (B, S, D)), "positions": arange_positions()}, training=True)


# ---------------------------------------------------------------- stacked vs repeated


def stack_pair(num_layers=2, remat_policy="none"):
    rep = build(
        RepeatedTransformer,
        input_dim=D,
        num_layers=num_layers,
        layer=layer_cfg(),
        remat_policy=remat_policy,
    )
    stk = build(StackedTransformer, input_dim=D, num_layers=num_layers, layer=layer_cfg())
    rep_params = init(rep)
    stk_params = {
        f"layer{i}": jax.tree.map(lambda a, i=i: a[i], rep_params["layer"])
        for i in range(num_layers)
    }
    return rep, stk, rep_params, stk_params


def test_repeated_params_have_leading_layer_axis():
    rep, stk, rep_params, _ = stack_pair(num_layers=2)
    single = init(stk)["layer0"]
    assert set(rep_params) == {"layer"}
    rep_shapes = jax.tree.map(lambda a: a.shape, rep_params["layer"])
    assert rep_shapes == jax.tree.map(lambda a: (2, *a.shape), single)
    # Layers are initialized independently.
    w = rep_params["layer"]["attention"]["qkv"]["q"]["weight"]
    assert not np.allclose(w[0], w[1])


@pytest.mark.parametrize("remat_policy", ["none", "full"])
def test_stacked_equals_repeated(remat_policy):
    rep, stk, rep_params, stk_params = stack_pair(remat_policy=remat_policy)
    x = normal(1, (B, S, D))
    segment_ids = np.array([[0, 0, 0, 1, 1, 1], [0, 0, 0, 0, 0, 0]], np.int32)
    positions = np.array([[0, 1, 2, 0, 1, 2], [0, 1, 2, 3, 4, 5]], np.int32)
    inputs = {"x": x, "positions": positions, "segment_ids": segment_ids}
    out_rep = run(rep, rep_params, inputs)
    out_stk = run(stk, stk_params, inputs)
    assert_close(out_rep, out_stk)
    # And both against the reference composition.
    mask = ref_mask(B, S, segment_ids=segment_ids)
    expected = x
    for i in range(2):
        expected = ref_transformer_layer(expected, stk_params[f"layer{i}"], mask)
    assert_close(out_stk, expected, F32_LOOSE)


@pytest.mark.parametrize("remat_policy", ["full", "none"])
def test_stacked_and_repeated_gradients_equal(remat_policy):
    rep, stk, rep_params, stk_params = stack_pair(remat_policy=remat_policy)
    x = normal(1, (B, S, D))
    positions = arange_positions()

    def loss(m, params, x):
        out = run(m, params, {"x": x, "positions": positions})
        return jnp.sum(jnp.sin(out))

    # jit: one compile of the whole backward pass is cheaper than eager op-by-op dispatch.
    g_rep, gx_rep = jax.jit(jax.grad(lambda p, x: loss(rep, p, x), argnums=(0, 1)))(rep_params, x)
    g_stk, gx_stk = jax.jit(jax.grad(lambda p, x: loss(stk, p, x), argnums=(0, 1)))(stk_params, x)
    g_stk_stacked = jax.tree.map(lambda *xs: np.stack(xs), *(g_stk[f"layer{i}"] for i in range(2)))
    assert jax.tree.structure(g_rep["layer"]) == jax.tree.structure(g_stk_stacked)
    for a, b in zip(jax.tree.leaves(g_rep["layer"]), jax.tree.leaves(g_stk_stacked), strict=True):
        assert_close(a, b, F32_LOOSE)
    assert_close(gx_rep, gx_stk, F32_LOOSE)


def test_repeated_dropout_training_changes_outputs():
    cfg = layer_cfg(dropout_rate=0.5)
    rep = build(RepeatedTransformer, input_dim=D, num_layers=2, layer=cfg)
    params = init(rep)
    inputs = {"x": normal(1, (B, S, D)), "positions": arange_positions()}
    ev = run(rep, params, inputs, prng_key=key(3))
    a = run(rep, params, inputs, prng_key=key(3), training=True)
    a2 = run(rep, params, inputs, prng_key=key(3), training=True)
    b = run(rep, params, inputs, prng_key=key(4), training=True)
    assert not np.allclose(a, ev)
    np.testing.assert_array_equal(np.asarray(a), np.asarray(a2))
    assert not np.allclose(a, b)


def test_unknown_remat_policy_error():
    with pytest.raises(ConfigError, match=r"model\.remat_policy: unknown policy 'most'.*full"):
        build(
            RepeatedTransformer, input_dim=D, num_layers=2, layer=layer_cfg(), remat_policy="most"
        )
    cfg = Decoder.default_config().set(vocab_size=V, dim=D)
    cfg.transformer = RepeatedTransformer.default_config().set(
        num_layers=2, layer=layer_cfg(), remat_policy="bogus"
    )
    with pytest.raises(ConfigError, match=r"model\.transformer\.remat_policy"):
        cfg.instantiate(parent=None)


# -------------------------------------------------------------------- decoder / causal lm


def lm_cfg(num_layers=2, tied=False, repeated=False, **root):
    cfg = CausalLM.default_config().set(**root)
    cfg.decoder.set(vocab_size=V, dim=D, tie_word_embeddings=tied)
    stack_cls = RepeatedTransformer if repeated else StackedTransformer
    cfg.decoder.transformer = stack_cls.default_config().set(
        num_layers=num_layers, layer=layer_cfg()
    )
    return cfg


def token_ids(seed=5) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, V, (B, S)).astype(np.int32)


@pytest.mark.parametrize("tied", [False, True])
def test_decoder_logits(tied):
    cfg = Decoder.default_config().set(vocab_size=V, dim=D, tie_word_embeddings=tied)
    cfg.transformer.set(num_layers=2, layer=layer_cfg())
    m = cfg.instantiate(parent=None)
    params = init(m)
    assert ("lm_head" in params) is (not tied)
    ids = token_ids()
    logits = run(m, params, (ids,))
    assert logits.shape == (B, S, V) and logits.dtype == jnp.float32
    assert_close(logits, ref_decoder(ids, params, 2, ref_mask(B, S), tied=tied), F32_LOOSE)


def test_decoder_tied_logits_are_normed_hidden_times_embedding_transpose():
    cfg = Decoder.default_config().set(vocab_size=V, dim=D, tie_word_embeddings=True)
    cfg.transformer.set(num_layers=1, layer=layer_cfg())
    m = cfg.instantiate(parent=None)
    params = init(m)
    assert set(params) == {"embedding", "transformer", "output_norm"}
    ids = token_ids()
    table = host(params["embedding"]["weight"])
    x = table[np.asarray(ids)]
    x = ref_transformer_layer(x, params["transformer"]["layer0"], ref_mask(B, S))
    x = ref_rms_norm(x, params["output_norm"])
    assert_close(run(m, params, (ids,)), x @ table.T, F32_LOOSE)


def test_decoder_embedding_scale():
    scale = math.sqrt(D)
    cfg = Decoder.default_config().set(vocab_size=V, dim=D, embedding_scale=scale)
    cfg.transformer.set(num_layers=1, layer=layer_cfg())
    m = cfg.instantiate(parent=None)
    params = init(m)
    ids = token_ids()
    x = host(params["embedding"]["weight"])[np.asarray(ids)] * scale
    x = ref_transformer_layer(x, params["transformer"]["layer0"], ref_mask(B, S))
    want = ref_rms_norm(x, params["output_norm"]) @ host(params["lm_head"]["weight"])
    assert_close(run(m, params, (ids,)), want, F32_LOOSE)
    # bf16 compute: the scale is a bf16 value first (HF: hidden * tensor(scale, hidden.dtype)).
    m16 = cfg.clone(compute_dtype="bfloat16").instantiate(parent=None)
    got = run(m16, params, (ids, arange_positions()), method="_embed")
    table16 = params["embedding"]["weight"].astype(jnp.bfloat16)
    want16 = table16[ids] * jnp.asarray(scale, jnp.bfloat16)
    assert got.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want16))
    for bad in (0.0, -2.0, float("inf")):
        with pytest.raises(ConfigError, match=r"^embedding_scale: .* must be a finite number > 0"):
            cfg.clone(embedding_scale=bad).instantiate(parent=None)


@pytest.mark.parametrize("tied", [False, True])
def test_decoder_final_logit_softcap(tied):
    cap = 0.5  # below the logits' scale, so the cap changes them
    cfg = Decoder.default_config().set(
        vocab_size=V, dim=D, tie_word_embeddings=tied, final_logit_softcap=cap
    )
    cfg.transformer.set(num_layers=2, layer=layer_cfg())
    m = cfg.instantiate(parent=None)
    params = init(m)
    ids = token_ids()
    raw = ref_decoder(ids, params, 2, ref_mask(B, S), tied=tied)
    assert float(np.abs(raw).max()) > 2 * cap
    logits = run(m, params, (ids,))
    assert logits.dtype == jnp.float32
    assert_close(logits, cap * np.tanh(raw / cap), F32_LOOSE)
    assert float(np.abs(np.asarray(logits)).max()) <= cap
    for bad in (0.0, -30.0, float("nan")):
        with pytest.raises(ConfigError, match=r"^final_logit_softcap: .* must be a finite num"):
            cfg.clone(final_logit_softcap=bad).instantiate(parent=None)


def test_decoder_position_embedding():
    cfg = Decoder.default_config().set(
        vocab_size=V, dim=D, position_embedding=Embedding.default_config(), max_positions=S + 1
    )
    cfg.transformer.set(num_layers=1, layer=layer_cfg())
    m = cfg.instantiate(parent=None)
    params = init(m)
    assert params["position_embedding"]["weight"].shape == (S + 1, D)
    ids = token_ids()
    # Packed rows: the table is read by position, not by index.
    segment_ids = np.array([[0, 0, 0, 1, 1, 1], [0, 0, 0, 0, 0, 0]], np.int32)
    positions = np.array([[0, 1, 2, 0, 1, 2], [1, 2, 3, 4, 5, 6]], np.int32)
    logits = run(m, params, {"input_ids": ids, "positions": positions, "segment_ids": segment_ids})
    table, wpe = host(params["embedding"]["weight"]), host(params["position_embedding"]["weight"])
    ids = np.asarray(ids)
    x = table[ids] + wpe[positions]
    mask = ref_mask(B, S, segment_ids=segment_ids)
    x = ref_transformer_layer(x, params["transformer"]["layer0"], mask)
    want = ref_rms_norm(x, params["output_norm"]) @ host(params["lm_head"]["weight"])
    assert_close(logits, want, F32_LOOSE)
    # Padding (EMPTY_POSITION) reads row 0; a real position past the table is NaN, not a
    # silently repeated row.
    from axplug.api import EMPTY_POSITION

    pad = np.array([[0, EMPTY_POSITION, S + 1]] * B, np.int32)
    x = np.asarray(run(m, params, (ids[:, :3], pad), method="_embed"))
    assert_close(x[:, :2], table[ids[:, :2]] + wpe[0])
    assert np.isnan(x[:, 2]).all()
    with pytest.raises(ConfigError, match=r"^max_positions: None: position_embedding needs"):
        cfg.clone(max_positions=None).instantiate(parent=None)
    with pytest.raises(ConfigError, match=r"^max_positions: 0: position_embedding needs"):
        cfg.clone(max_positions=0).instantiate(parent=None)
    with pytest.raises(ConfigError, match=r"^max_positions: is read only with position_emb"):
        cfg.clone(position_embedding=None).instantiate(parent=None)


class LossFusingStack(StackedTransformer):
    """A stack that computes the loss itself when training, as a 1F1B pipeline does (through
    `Decoder.fused_loss`), here without any pipeline."""

    fuses_loss = True

    def forward_with_loss(self, x, *, head, head_params, labels, **kwargs):
        return head(head_params, self.forward(x, **kwargs), labels)


DECODER_OPTIONS = {
    "embedding_scale": dict(embedding_scale=math.sqrt(D)),
    "final_logit_softcap": dict(final_logit_softcap=0.5),
    "position_embedding": dict(position_embedding=Embedding.default_config(), max_positions=S),
}


@pytest.mark.parametrize("options", list(DECODER_OPTIONS.values()), ids=list(DECODER_OPTIONS))
def test_fused_loss_equals_the_loss_of_the_logits_with_decoder_options(options):
    cfg = lm_cfg(tied=True)
    cfg.decoder.set(**options)
    cfg.decoder.transformer = LossFusingStack.default_config().set(num_layers=2, layer=layer_cfg())
    m = cfg.instantiate(parent=None)
    assert m.decoder.fuses_loss
    params = init(m)
    ids = token_ids()
    labels = np.roll(ids, -1, axis=1)
    labels[:, -1] = -1
    inputs = {"input_ids": ids, "target_labels": labels}
    (fused, aux), _ = functional(m, prng_key=key(0), state=params, inputs=inputs, is_training=True)
    assert aux["logits"] is None  # the fused path ran
    (plain, aux), _ = functional(m, prng_key=None, state=params, inputs=inputs, is_training=False)
    assert_close(fused, plain)
    assert_close(plain, ref_xent(aux["logits"], labels)[0], F32_LOOSE)


@pytest.mark.parametrize("tied", [False, True])
def test_causal_lm_loss_with_ignored_labels(tied):
    m = lm_cfg(tied=tied).instantiate(parent=None)
    params = init(m)
    ids = token_ids()
    labels = np.roll(ids, -1, axis=1)
    labels[:, -1] = labels[0, 1] = -1
    (loss, aux), coll = functional(
        m,
        prng_key=None,
        state=params,
        inputs={"input_ids": ids, "target_labels": labels},
        is_training=False,
    )
    logits = aux["logits"]
    assert logits.shape == (B, S, V)
    expected_logits = ref_decoder(ids, params["decoder"], 2, ref_mask(B, S), tied=tied)
    assert_close(logits, expected_logits, F32_LOOSE)
    ref_loss, ref_count = ref_xent(expected_logits, labels)
    assert int(aux["num_tokens"]) == ref_count == B * S - 3
    assert_close(loss, ref_loss, F32_LOOSE)
    assert_close(coll.summaries["loss"], loss)
    # predict() returns the same logits.
    predicted = run(m, params, (ids,), method="predict")
    assert_close(predicted, logits)


def test_causal_lm_repeated_equals_stacked():
    rep = lm_cfg(num_layers=2, repeated=True).instantiate(parent=None)
    stk = lm_cfg(num_layers=2, repeated=False).instantiate(parent=None)
    rep_params = init(rep)
    stk_params = jax.tree.map(lambda a: a, rep_params)
    layers = rep_params["decoder"]["transformer"]["layer"]
    stk_params["decoder"]["transformer"] = {
        f"layer{i}": jax.tree.map(lambda a, i=i: a[i], layers) for i in range(2)
    }
    ids = token_ids()
    inputs = {"input_ids": ids, "target_labels": ids}
    (loss_r, aux_r), _ = functional(
        rep, prng_key=None, state=rep_params, inputs=inputs, is_training=False
    )
    (loss_s, aux_s), _ = functional(
        stk, prng_key=None, state=stk_params, inputs=inputs, is_training=False
    )
    assert_close(aux_r["logits"], aux_s["logits"])
    assert_close(loss_r, loss_s)


def test_cross_entropy_ignores_negative_labels():
    logits = normal(1, (B, S, V))
    labels = np.array([[1, -1, 3, 4, -100, 0], [10, 2, -1, -1, 5, 6]], np.int32)
    loss, count = cross_entropy(logits, labels)
    ref_loss, ref_count = ref_xent(logits, labels)
    assert int(count) == ref_count == 8
    assert_close(loss, ref_loss)
    # Changing logits at ignored positions changes nothing.
    logits2 = np.array(logits)
    logits2[0, 1], logits2[1, 2:4] = 100.0, -50.0
    assert_close(cross_entropy(logits2, labels)[0], loss)
    # All labels ignored: zero loss over zero tokens (no NaN).
    loss0, count0 = cross_entropy(logits, np.full((B, S), -1, np.int32))
    assert int(count0) == 0 and float(loss0) == 0.0
    # bf16 logits are upcast: the loss is float32.
    loss_bf16, _ = cross_entropy(logits.astype(jnp.bfloat16), labels)
    assert loss_bf16.dtype == jnp.float32
    assert_close(loss_bf16, loss, BF16)


# ------------------------------------------------------------ param vs compute dtypes


def walk(module):
    yield module
    for child in module.children.values():
        yield from walk(child)


def test_linear_param_float32_compute_bfloat16():
    m = build(
        Linear, input_dim=D, output_dim=F, bias=True, dtype="float32", compute_dtype="bfloat16"
    )
    params = init(m)
    assert all(p.dtype == jnp.float32 for p in jax.tree.leaves(params))
    x = normal(1, (B, S, D))
    out = run(m, params, (x,))
    assert out.dtype == jnp.bfloat16
    assert_close(out, ref_linear(x, params), BF16)


def test_children_inherit_dtypes():
    m = lm_cfg(dtype="float32", compute_dtype="bfloat16").instantiate(parent=None)
    modules = list(walk(m))
    assert len(modules) > 10
    for mod in modules:
        assert mod.dtype == jnp.float32, mod.path
        assert mod.compute_dtype == jnp.bfloat16, mod.path
    params = init(m)
    assert all(p.dtype == jnp.float32 for p in jax.tree.leaves(params))
    specs = m.create_parameter_specs_recursively()
    assert all(
        s.dtype == jnp.float32
        for s in jax.tree.leaves(specs, is_leaf=lambda s: isinstance(s, ParameterSpec))
    )
    # A root storage dtype of bfloat16 is inherited too (and is then the compute dtype).
    m16 = lm_cfg(dtype="bfloat16").instantiate(parent=None)
    shapes16 = jax.eval_shape(m16.initialize_parameters_recursively, key(0))  # no compile
    assert all(p.dtype == jnp.bfloat16 for p in jax.tree.leaves(shapes16))
    assert all(mod.compute_dtype == jnp.bfloat16 for mod in walk(m16))
    # A child's explicit setting wins over the inherited one.
    cfg = lm_cfg(dtype="float32", compute_dtype="bfloat16")
    cfg.decoder.lm_head.set(compute_dtype="float32")
    m_mixed = cfg.instantiate(parent=None)
    assert m_mixed.decoder.lm_head.compute_dtype == jnp.float32
    assert m_mixed.decoder.embedding.compute_dtype == jnp.bfloat16


@pytest.mark.parametrize("norm_cls", [RMSNorm, LayerNorm])
def test_norms_compute_in_float32(norm_cls):
    m = build(norm_cls, input_dim=D, dtype="float32", compute_dtype="bfloat16")
    params = init(m)

    def ref(x, p):
        """The norm in float32 jnp, as the layer computes it: with the 300 offset below, the
        float32 cancellation's roundings (which a float64 reference lacks) flip ~10% of the
        bf16 values, so this reference keeps them."""
        if norm_cls is RMSNorm:
            return x / jnp.sqrt(jnp.mean(x**2, axis=-1, keepdims=True) + 1e-6) * p["scale"]
        mu = x.mean(-1, keepdims=True)
        var = ((x - mu) ** 2).mean(-1, keepdims=True)
        y = (x - mu) / jnp.sqrt(var + 1e-5) * p["scale"]
        return y + p["bias"] if "bias" in p else y

    def check(x):
        out = run(m, params, (x,))
        assert out.dtype == jnp.bfloat16
        expected = ref(x.astype(jnp.float32), params)
        # One bf16 rounding of the float32 result: relative 2^-9 (plus slack) ...
        np.testing.assert_allclose(
            np.asarray(out, np.float32), np.asarray(expected), rtol=2**-8, atol=1e-2
        )
        # ... and almost always the very same bf16 value; computing in bf16 matches only
        # ~50% of elements for these inputs.
        same = np.asarray(out) == np.asarray(expected.astype(jnp.bfloat16))
        assert same.mean() >= 0.95, same.mean()

    # A large common offset with small variations: lost entirely if x were cast to bf16 first
    # (bf16 spacing at 300 is 2), kept by a float32 computation.
    check(300.0 + 0.1 * normal(1, (B, S, D)))
    # bf16 input: still computed in float32 from the bf16 values.
    check((3.0 * normal(2, (B, S, D))).astype(jnp.bfloat16))


def test_causal_lm_bf16_compute_close_to_float32():
    m32 = lm_cfg().instantiate(parent=None)
    m16 = lm_cfg(dtype="float32", compute_dtype="bfloat16").instantiate(parent=None)
    params = init(m32)
    assert_trees_equal(params, init(m16))
    ids = token_ids()
    inputs = {"input_ids": ids, "target_labels": ids}
    (loss32, aux32), _ = functional(
        m32, prng_key=None, state=params, inputs=inputs, is_training=False
    )
    (loss16, aux16), _ = functional(
        m16, prng_key=None, state=params, inputs=inputs, is_training=False
    )
    assert aux32["logits"].dtype == jnp.float32
    assert aux16["logits"].dtype == jnp.bfloat16
    assert loss16.dtype == jnp.float32
    # Logits are O(few): compare with a bf16 tolerance scaled to their magnitude.
    scale = float(np.abs(np.asarray(aux32["logits"])).max())
    np.testing.assert_allclose(
        np.asarray(aux16["logits"], np.float32),
        np.asarray(aux32["logits"]),
        rtol=BF16["rtol"],
        atol=BF16["atol"] * max(scale, 1.0),
    )
    assert_close(loss16, loss32, BF16)


# ---------------------------------------------------------------------- parameter specs


def flat_specs(specs):
    return jax.tree_util.tree_flatten_with_path(
        specs, is_leaf=lambda s: isinstance(s, ParameterSpec)
    )[0]


@pytest.mark.parametrize("repeated", [False, True])
@pytest.mark.parametrize("tied", [False, True])
def test_parameter_specs_match_initialized_params(repeated, tied):
    m = lm_cfg(num_layers=2, repeated=repeated, tied=tied).instantiate(parent=None)
    specs = m.create_parameter_specs_recursively()
    params = m.initialize_parameters_recursively(key(0))
    assert jax.tree.structure(
        jax.tree.map(lambda s: 0, specs, is_leaf=lambda s: isinstance(s, ParameterSpec))
    ) == jax.tree.structure(jax.tree.map(lambda a: 0, params))
    spec_leaves = flat_specs(specs)
    param_leaves = jax.tree_util.tree_flatten_with_path(params)[0]
    assert len(spec_leaves) == len(param_leaves) > 0
    for (spath, spec), (ppath, p) in zip(spec_leaves, param_leaves, strict=True):
        where = jax.tree_util.keystr(spath)
        assert spath == ppath
        assert spec.shape == p.shape, where
        assert jnp.dtype(spec.dtype) == p.dtype, where
        assert len(spec.mesh_axes) == len(spec.shape), where
        assert set(spec.mesh_axes) <= LOGICAL_AXES, (where, spec.mesh_axes)
        name = spath[-1].key
        in_norm = any("norm" in str(k.key) for k in spath)
        if name == "bias" or in_norm:
            assert spec.weight_decay_scale == 0.0, where
        else:
            assert spec.weight_decay_scale == 1.0, where
        if repeated and "transformer" in where:
            assert spec.mesh_axes[0] == "layers" and spec.shape[0] == 2, where
        else:
            assert "layers" not in spec.mesh_axes, where
    flat = {jax.tree_util.keystr(p): s for p, s in spec_leaves}
    assert flat["['decoder']['embedding']['weight']"].mesh_axes == ("vocab", "embed")
    if not tied:
        assert flat["['decoder']['lm_head']['weight']"].mesh_axes == ("embed", "vocab")


def test_parameter_specs_bias_and_layer_norm_no_weight_decay():
    m = build(Linear, input_dim=D, output_dim=F, bias=True)
    specs = m.create_parameter_specs_recursively()
    assert specs["weight"].weight_decay_scale == 1.0
    assert specs["bias"].weight_decay_scale == 0.0
    assert specs["bias"].mesh_axes == ("mlp",)
    ln = build(LayerNorm, input_dim=D).create_parameter_specs_recursively()
    assert {k: s.weight_decay_scale for k, s in ln.items()} == {"scale": 0.0, "bias": 0.0}


def test_parameter_spec_rejects_wrong_mesh_axes_length():
    with pytest.raises(ValueError, match="one axis per dim"):
        ParameterSpec((2, 3), jnp.float32, ("embed",), jax.nn.initializers.zeros)


# ------------------------------------------------------------------ per-name PRNG stability


def test_adding_a_layer_keeps_existing_params():
    p2 = init(lm_cfg(num_layers=2).instantiate(parent=None), randomize_norms=False)
    p3 = init(lm_cfg(num_layers=3).instantiate(parent=None), randomize_norms=False)
    t2, t3 = p2["decoder"]["transformer"], p3["decoder"]["transformer"]
    assert set(t3) == {"layer0", "layer1", "layer2"}
    assert_trees_equal(t2["layer0"], t3["layer0"])
    assert_trees_equal(t2["layer1"], t3["layer1"])
    for name in ("embedding", "output_norm", "lm_head"):
        assert_trees_equal(p2["decoder"][name], p3["decoder"][name])
    # The new layer is not a copy of an old one.
    w = lambda t, i: t[f"layer{i}"]["attention"]["qkv"]["q"]["weight"]
    assert not np.allclose(w(t3, 2), w(t3, 1))


def test_adding_a_repeated_layer_keeps_existing_slices():
    p2 = init(lm_cfg(num_layers=2, repeated=True).instantiate(parent=None), randomize_norms=False)
    p3 = init(lm_cfg(num_layers=3, repeated=True).instantiate(parent=None), randomize_norms=False)
    l2 = p2["decoder"]["transformer"]["layer"]
    l3 = p3["decoder"]["transformer"]["layer"]
    assert_trees_equal(l2, jax.tree.map(lambda a: a[:2], l3))


def test_adding_a_sibling_keeps_existing_params():
    # A child added to a config: lm_head appears when embeddings are untied.
    tied = init(lm_cfg(tied=True).instantiate(parent=None), randomize_norms=False)
    untied = init(lm_cfg(tied=False).instantiate(parent=None), randomize_norms=False)
    assert "lm_head" in untied["decoder"] and "lm_head" not in tied["decoder"]
    for name in ("embedding", "transformer", "output_norm"):
        assert_trees_equal(tied["decoder"][name], untied["decoder"][name])
    # A gate added to a feed-forward.
    ungated = init(build(FeedForward, input_dim=D, hidden_dim=F, gated=False), 3, False)
    gated = init(build(FeedForward, input_dim=D, hidden_dim=F, gated=True), 3, False)
    assert set(gated) - set(ungated) == {"wi_gate"}
    assert_trees_equal(ungated["wi_up"], gated["wi_up"])
    assert_trees_equal(ungated["wo"], gated["wo"])
    # A parameter added next to another: a Linear's bias.
    nb = init(build(Linear, input_dim=D, output_dim=F, bias=False), 3, False)
    wb = init(build(Linear, input_dim=D, output_dim=F, bias=True), 3, False)
    assert_trees_equal(nb["weight"], wb["weight"])


def test_initialization_is_deterministic_and_key_dependent():
    m = lm_cfg().instantiate(parent=None)
    a = m.initialize_parameters_recursively(key(0))
    assert_trees_equal(a, m.initialize_parameters_recursively(key(0)))
    b = m.initialize_parameters_recursively(key(1))
    wa = a["decoder"]["embedding"]["weight"]
    assert not np.allclose(wa, b["decoder"]["embedding"]["weight"])
    # Same-shaped siblings get different values (keys fold in the name).
    qkv = a["decoder"]["transformer"]["layer0"]["attention"]["qkv"]
    assert not np.allclose(qkv["q"]["weight"], qkv["k"]["weight"])
