"""The axplug-attention plugin: RoPE, GQA, masks, KV-cache decoding, modifiers, tensor-parallel
sharding, and the kernel names it re-exports from the core. Kernel dispatch and numerics are in
tests/test_kernels.py.

Tolerance policy (as in tests/test_layers.py): float32 layer outputs rtol = atol = 1e-5; whole
models, gradients and runs on different meshes or in different chunkings (prefill vs decode,
which reduce in different orders) 1e-4. Structural checks are exact.
"""

from __future__ import annotations

import functools
import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from axplug.api import registry

axplug_attention = pytest.importorskip("axplug_attention")
if not any(c.distribution == "axplug-attention" and c.loadable for c in registry.discover()):
    pytest.skip("axplug-attention is disabled", allow_module_level=True)

from axplug_attention import (  # noqa: E402
    GroupedQKVLinear,
    RotaryPositionTransform,
    apply_rope,
    rope_frequencies,
)
from axplug_testing import cli_main as main  # noqa: E402
from axplug_testing import run_cli  # noqa: E402

from axplug.api import HFFields  # noqa: E402
from axplug.api.config import (  # noqa: E402
    ConfigError,
    make_modifier,  # noqa: E402
    preset_config,  # noqa: E402
    to_dict,
)
from axplug.api.layers import (
    Attention,
    CausalLM,
    DotProductKernel,
    FlashAttention,
    IdentityPositionTransform,
    QKVLinear,
    RepeatedTransformer,
    RMSNorm,
    functional,
)
from axplug.api.sharding import DEFAULT_AXIS_RULES, MeshBuilder, parameter_shardings  # noqa: E402

F32 = dict(rtol=1e-5, atol=1e-5)
F32_LOOSE = dict(rtol=1e-4, atol=1e-4)
B, S, D, H = 2, 8, 32, 4  # batch, seq, model dim, heads (head_dim 8)
DIST = "axplug-attention"


# Inputs and references in numpy: an eager jnp op compiles a program per shape.
def normal(i: int, shape, dtype=np.float32) -> np.ndarray:
    return np.random.default_rng(i).standard_normal(shape).astype(dtype)


def arange_positions(b: int = B, s: int = S) -> np.ndarray:
    return np.broadcast_to(np.arange(s, dtype=np.int32), (b, s))


@functools.cache
def _jitted(m, method: str):
    def call(params, inputs):
        out, _ = functional(
            m, prng_key=None, state=params, inputs=inputs, is_training=False, method=method
        )
        return out

    return jax.jit(call)


def run(m, params, inputs, method="forward"):
    """`m.<method>(inputs)` under jit (one compile instead of one per eager op)."""
    return _jitted(m, method)(params, inputs)


def assert_close(actual, desired, tol=F32):
    np.testing.assert_allclose(
        np.asarray(actual, np.float32), np.asarray(desired, np.float32), **tol
    )


def attention_cfg(*modifiers: str, **kwargs):
    """An Attention config (input_dim D, H heads) with modifier specs applied to it."""
    cfg = Attention.default_config().set(input_dim=D, num_heads=H, **kwargs)
    for spec in modifiers:
        cfg = make_modifier(spec)(cfg)
    return cfg


def build(cfg, seed: int = 0):
    m = cfg.instantiate(parent=None)
    return m, m.initialize_parameters_recursively(jax.random.PRNGKey(seed))


# ------------------------------------------------------------------ distribution and CLI

EXPECTED = {
    ("layers", "rope"),
    ("layers", "gqa_qkv_linear"),
    ("layers", "mla"),
    ("modifiers", "rope"),
    ("modifiers", "gqa"),
    ("modifiers", "sliding_window"),
    ("modifiers", "alibi"),
    ("presets", "llama-tiny"),
    ("presets", "llama2-7b"),
    ("presets", "llama2-70b"),
    ("presets", "llama3-8b"),
    ("architectures", "LlamaForCausalLM"),
}


def test_list_json_shows_this_distribution_components(capsys):
    assert main(["list", "--json"]) == 0
    rows = [r for r in json.loads(capsys.readouterr().out) if r["distribution"] == DIST]
    assert {(r["kind"], r["name"]) for r in rows} == EXPECTED
    import importlib_metadata

    version = importlib_metadata.version(DIST)
    assert all(r["status"] == "ok" and r["version"] == version for r in rows), rows


def test_list_check_imports_every_component(capsys):
    assert main(["list", "--check", "--json"]) == 0
    rows = [r for r in json.loads(capsys.readouterr().out) if r["distribution"] == DIST]
    assert {r["status"] for r in rows} == {"ok"}


def test_core_alone_names_the_missing_preset_and_lists_its_own(plugin_site, tmp_path):
    # Only the core installed: `plugin_site` discovers the core alone (this distribution's
    # metadata hidden, the registry reset), so no fresh interpreter is needed.
    result = run_cli("train", "--preset", "llama-tiny", "--output-dir", str(tmp_path))
    assert result.exit_code == 2, result.stderr
    # llama-tiny is this plugin's; the core's own preset is still there.
    assert result.stderr.startswith("error: no presets component named 'llama-tiny'"), result
    assert "gpt-tiny" in result.stderr and "llama2-7b" not in result.stderr


def test_kernel_names_are_the_cores_re_exported():
    # Moved to the core; old imports and saved configs (`module:Qualname`) still resolve.
    import axplug.api as floor
    import axplug.api.kernels as core_kernels
    import axplug.api.layers as core_layers
    from axplug.api.config import resolve_class

    for name in ("ReferenceKernel", "XlaKernel", "select_kernel"):
        assert getattr(axplug_attention, name) is getattr(core_kernels, name), name
    assert axplug_attention.Unsupported is floor.Unsupported
    assert axplug_attention.FlashAttention is core_layers.FlashAttention
    assert axplug_attention.kernels.check_shapes is floor.check_shapes
    assert axplug_attention.modifiers.FlashAttentionModifier is core_layers.FlashAttentionModifier
    assert resolve_class("axplug_attention.dispatch:FlashAttention") is FlashAttention
    assert set(axplug_attention.__all__) <= set(dir(axplug_attention))


# ----------------------------------------------------------------------------------- RoPE


def ref_rotary(x, positions, *, theta=10000.0, fraction=1.0, interleaved=False, freqs=None):
    """Rotary embedding as complex multiplication, in numpy float64."""
    x = np.asarray(x, np.float64)
    d = x.shape[-1]
    rot = int(d * fraction) // 2 * 2
    if freqs is None:
        freqs = np.array([theta ** (-2.0 * i / rot) for i in range(rot // 2)])
    if interleaved:
        re, im = x[..., 0:rot:2], x[..., 1:rot:2]
    else:
        re, im = x[..., : rot // 2], x[..., rot // 2 : rot]
    angle = np.asarray(positions, np.float64)[:, :, None, None] * freqs  # [b, s, 1, rot/2]
    z = (re + 1j * im) * np.exp(1j * angle)
    out = x.copy()
    if interleaved:
        out[..., 0:rot:2], out[..., 1:rot:2] = z.real, z.imag
    else:
        out[..., : rot // 2], out[..., rot // 2 : rot] = z.real, z.imag
    return out


def ref_llama3_freqs(rot, theta, factor, low, high, old_len):
    """Llama 3.1 frequency scaling, written from the published recipe."""
    out = []
    for i in range(rot // 2):
        freq = theta ** (-2.0 * i / rot)
        wavelen = 2 * math.pi / freq
        if wavelen < old_len / high:
            out.append(freq)
        elif wavelen > old_len / low:
            out.append(freq / factor)
        else:
            smooth = (old_len / wavelen - low) / (high - low)
            out.append((1 - smooth) * freq / factor + smooth * freq)
    return np.array(out)


@pytest.mark.parametrize(
    ("fraction", "interleaved", "theta"),
    [(1.0, False, 10000.0), (0.5, False, 500000.0), (1.0, True, 10000.0), (0.25, True, 100.0)],
)
def test_rope_matches_plain_rotary(fraction, interleaved, theta):
    m, _ = build(
        RotaryPositionTransform.default_config().set(
            head_dim=16, theta=theta, rotary_fraction=fraction, interleaved=interleaved
        )
    )
    q, k = normal(1, (B, S, 4, 16)), normal(2, (B, S, 2, 16))
    qpos = np.random.default_rng(3).integers(0, 5000, (B, S)).astype(np.int32)
    kpos = arange_positions() + 7
    q2, k2 = run(m, {}, {"q": q, "k": k, "q_positions": qpos, "kv_positions": kpos})
    kw = dict(theta=theta, fraction=fraction, interleaved=interleaved)
    # Positions up to 5000: float32 angles carry ~5000 * 2^-24 rad of rounding.
    assert_close(q2, ref_rotary(q, qpos, **kw), dict(rtol=1e-4, atol=1e-3))
    assert_close(k2, ref_rotary(k, kpos, **kw))
    rot = int(16 * fraction)
    partial = np.asarray(q2)[..., rot:]  # numpy: a jax slice would compile a program
    assert_close(partial, q[..., rot:], dict(rtol=0, atol=0))  # partial: rest untouched


def test_rope_score_depends_only_on_relative_offset():
    m, _ = build(RotaryPositionTransform.default_config().set(head_dim=16, theta=500.0))
    q, k = normal(1, (1, 1, 1, 16)), normal(2, (1, 1, 1, 16))

    def score(qp, kp):
        pos = lambda p: np.full((1, 1), p, np.int32)  # noqa: E731
        q2, k2 = run(m, {}, {"q": q, "k": k, "q_positions": pos(qp), "kv_positions": pos(kp)})
        return float(np.sum(np.asarray(q2) * np.asarray(k2)))

    for offset in (0, 1, 5, -3):
        scores = [score(p + offset, p) for p in (0, 7, 100, 1000)]
        assert_close(scores, [scores[0]] * 4, dict(rtol=1e-4, atol=1e-4))
    assert abs(score(5, 0) - score(0, 0)) > 1e-3  # ...and it does depend on the offset


def test_rope_frequencies_llama3_scaling():
    got = rope_frequencies(
        128,
        theta=500000.0,
        scaling_factor=8.0,
        low_freq_factor=1.0,
        high_freq_factor=4.0,
        original_max_position=8192,
    )
    want = ref_llama3_freqs(128, 500000.0, 8.0, 1.0, 4.0, 8192)
    assert_close(got, want, dict(rtol=1e-6, atol=0))
    plain = rope_frequencies(128, theta=500000.0)
    assert plain[0] == got[0] and got[-1] == pytest.approx(plain[-1] / 8, rel=1e-6)
    assert (got <= plain).all() and (got < plain).sum() > 0


def test_rope_llama3_scaling_in_the_layer():
    cfg = RotaryPositionTransform.default_config().set(
        head_dim=16, theta=10000.0, scaling_factor=4.0, original_max_position=64
    )
    m, _ = build(cfg)
    q = normal(1, (B, S, 2, 16))
    pos = arange_positions() * 37
    q2, _ = run(m, {}, {"q": q, "k": q, "q_positions": pos, "kv_positions": pos})
    freqs = ref_llama3_freqs(16, 10000.0, 4.0, 1.0, 4.0, 64)
    assert_close(q2, ref_rotary(q, pos, freqs=freqs), dict(rtol=1e-5, atol=1e-4))


YARN_CASES = {
    # DeepSeek-V3's: mscale = mscale_all_dim, so the rotated dims keep their scale.
    "deepseek": dict(factor=40.0, original_max_position_embeddings=4096, beta_fast=32,
                     beta_slow=1, mscale=1.0, mscale_all_dim=1.0),
    "no-mscale-untruncated": dict(factor=4.0, original_max_position_embeddings=32,
                                  beta_fast=16, beta_slow=2, truncate=False),
    "mscales-differ": dict(factor=4.0, original_max_position_embeddings=32, mscale=0.707,
                           mscale_all_dim=1.0),
}  # fmt: skip


@pytest.mark.parametrize("case", list(YARN_CASES))
def test_rope_yarn_matches_transformers(case):
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = {"rope_type": "yarn", "rope_theta": 10000.0, **YARN_CASES[case]}
    config = transformers.LlamaConfig(
        hidden_size=64, num_attention_heads=2, max_position_embeddings=128, rope_parameters=params
    )
    want_freqs, want_factor = ROPE_INIT_FUNCTIONS["yarn"](config)
    cfg = RotaryPositionTransform.default_config()
    fields = HFFields({"rope_parameters": params})
    RotaryPositionTransform.hf_read(cfg, fields)
    assert not fields.problems
    layer, _ = build(cfg.set(head_dim=32))
    assert_close(layer.frequencies(32), want_freqs.numpy(), dict(rtol=1e-6, atol=0))
    assert layer.attention_factor() == pytest.approx(want_factor, rel=1e-12)
    written = RotaryPositionTransform.hf_write(cfg)["rope_parameters"]
    again = RotaryPositionTransform.default_config()
    RotaryPositionTransform.hf_read(again, HFFields({"rope_parameters": written}))
    assert to_dict(again) == to_dict(cfg.set(head_dim=None))


def test_rope_linear_scaling_divides_the_frequencies_as_positions():
    assert_close(
        rope_frequencies(16, theta=500.0, linear_scaling_factor=4.0),
        rope_frequencies(16, theta=500.0) / 4.0,
        dict(rtol=1e-6, atol=0),
    )
    cfg = RotaryPositionTransform.default_config().set(head_dim=16, linear_scaling_factor=4.0)
    m, _ = build(cfg)
    plain, _ = build(RotaryPositionTransform.default_config().set(head_dim=16))
    q = normal(1, (B, S, 2, 16))
    pos = arange_positions() * 4
    got, _ = run(m, {}, {"q": q, "k": q, "q_positions": pos, "kv_positions": pos})
    want, _ = run(plain, {}, {"q": q, "k": q, "q_positions": pos // 4, "kv_positions": pos // 4})
    assert_close(got, want)


@pytest.mark.parametrize(
    "raw",
    [
        {"rope_theta": 1e6, "rope_scaling": {"rope_type": "linear", "factor": 8.0}},
        {"rope_parameters": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6}},
    ],
    ids=["transformers4", "transformers5"],
)
def test_rope_reads_and_writes_linear_scaling(raw):
    from axplug.api import HFFields

    cfg = RotaryPositionTransform.default_config()
    fields = HFFields(raw)
    RotaryPositionTransform.hf_read(cfg, fields)
    assert fields.problems == []
    assert (cfg.theta, cfg.linear_scaling_factor, cfg.scaling_factor) == (1e6, 8.0, None)
    written = RotaryPositionTransform.hf_write(cfg)
    assert written["rope_scaling"] == {"rope_type": "linear", "factor": 8.0}
    assert written["rope_parameters"] == {
        "rope_type": "linear", "factor": 8.0, "rope_theta": 1e6, "partial_rotary_factor": 1.0
    }  # fmt: skip
    with pytest.raises(ValueError, match="more than one of Llama 3, linear and YaRN"):
        RotaryPositionTransform.hf_write(cfg.clone(scaling_factor=8.0))


def test_rope_writes_a_whole_rotary_fraction_for_families_whose_default_is_a_part():
    written = RotaryPositionTransform.hf_write(RotaryPositionTransform.default_config())
    assert written["partial_rotary_factor"] == 1.0
    assert written["rope_parameters"]["partial_rotary_factor"] == 1.0
    for form in ({"rope_parameters": written["rope_parameters"]}, written):
        # Read back by a family whose Hugging Face default is a quarter (StableLM's).
        fields = HFFields(form, defaults={"partial_rotary_factor": 0.25})
        again = RotaryPositionTransform.default_config()
        RotaryPositionTransform.hf_read(again, fields)
        assert again.rotary_fraction == 1.0


def test_rope_refuses_a_rope_parameters_keyed_by_layer_type_that_no_parent_read():
    from axplug.api import HFFields

    keyed = {
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
    }
    fields = HFFields({"rope_parameters": keyed})
    RotaryPositionTransform.hf_read(RotaryPositionTransform.default_config(), fields)
    assert any("keyed by layer type" in p for p in fields.problems)
    # A parent that read it (a patterned stack) leaves the template the full entry.
    fields = HFFields({"rope_parameters": keyed})
    fields.get("rope_parameters")
    cfg = RotaryPositionTransform.default_config()
    RotaryPositionTransform.hf_read(cfg, fields)
    assert fields.problems == [] and (cfg.theta, cfg.linear_scaling_factor) == (1e6, 8.0)


def test_rope_config_errors_name_the_field():
    with pytest.raises(ConfigError, match=r"rotary_fraction: 1.5 is not in \(0, 1\]"):
        build(RotaryPositionTransform.default_config().set(rotary_fraction=1.5))
    with pytest.raises(ConfigError, match="rotates no pair of dims"):
        build(RotaryPositionTransform.default_config().set(head_dim=4, rotary_fraction=0.25))
    with pytest.raises(ConfigError, match="high_freq_factor"):
        build(
            RotaryPositionTransform.default_config().set(scaling_factor=8.0, high_freq_factor=1.0)
        )
    with pytest.raises(ConfigError, match="linear_scaling_factor: -2.0 is not a positive"):
        build(RotaryPositionTransform.default_config().set(linear_scaling_factor=-2.0))


def test_rope_attention_uses_input_positions_for_packed_sequences():
    m, params = build(attention_cfg("rope"))
    x = normal(1, (1, S, D))
    segment_ids = np.array([[0, 0, 0, 0, 0, 1, 1, 1]], np.int32)
    positions = np.array([[0, 1, 2, 3, 4, 0, 1, 2]], np.int32)
    packed = run(m, params, {"x": x, "positions": positions, "segment_ids": segment_ids})
    first = run(m, params, {"x": x[:, :5], "positions": arange_positions(1, 5)})
    second = run(m, params, {"x": x[:, 5:], "positions": arange_positions(1, 3)})
    assert_close(packed, np.concatenate([first, second], axis=1))
    # Shifting every position by the same offset leaves RoPE attention unchanged ...
    shifted = run(m, params, {"x": x[:, :5], "positions": arange_positions(1, 5) + 1000})
    assert_close(shifted, first, F32_LOOSE)


def test_apply_rope_keeps_dtype():
    x = jax.device_put(normal(1, (1, 3, 2, 8), jnp.bfloat16))
    y = jax.jit(apply_rope)(x, arange_positions(1, 3), rope_frequencies(8))  # one program
    assert y.dtype == jnp.bfloat16 and y.shape == x.shape


# ------------------------------------------------------------------------------------ GQA


def repeat_kv_columns(w, kv_heads, heads):
    """[D, kv_heads * d] -> [D, heads * d], each kv head's columns repeated for its group."""
    d_in = w.shape[0]
    w = np.asarray(w).reshape(d_in, kv_heads, -1)
    return np.repeat(w, heads // kv_heads, axis=1).reshape(d_in, -1)


@pytest.mark.parametrize("kv_heads", [1, 2])
@pytest.mark.parametrize("flash", [False, True], ids=["core_kernel", "flash"])
def test_gqa_equals_mha_with_repeated_kv_weights(kv_heads, flash):
    mods = [f"gqa:num_kv_heads={kv_heads}", "rope"] + (["flash_attention"] if flash else [])
    gqa, gparams = build(attention_cfg(*mods))
    assert gparams["qkv"]["k"]["weight"].shape == (D, kv_heads * D // H)
    mha, _ = build(attention_cfg(*mods[1:]))
    qkv = gparams["qkv"]
    mparams = {
        "qkv": {
            "q": qkv["q"],
            "k": {"weight": repeat_kv_columns(qkv["k"]["weight"], kv_heads, H)},
            "v": {"weight": repeat_kv_columns(qkv["v"]["weight"], kv_heads, H)},
        },
        "output": gparams["output"],
    }
    x = normal(1, (B, S, D))
    inputs = {"x": x, "positions": arange_positions()}
    assert_close(run(gqa, gparams, inputs), run(mha, mparams, inputs))


def ref_rms(x, scale, eps=1e-6):
    return x / np.sqrt(np.mean(x**2, axis=-1, keepdims=True) + eps) * np.asarray(scale, np.float64)


def ref_gqa_attention(
    x, p, kv_heads, *, positions=None, qk_norm_over=None, rope=False, softcap=None, scale=None
):
    """Causal GQA attention in float64 numpy: q, k, v projections (biases where present), q/k
    RMSNorm over the whole projection or per head, RoPE, each kv head repeated for its group
    of query heads, softmax(softcap(q k^T * scale)) v (scale 1/sqrt(d) unless given), output."""
    f = lambda a: np.asarray(a, np.float64)  # noqa: E731
    x = f(x)
    b, s, _ = x.shape
    pos = arange_positions(b, s) if positions is None else positions
    proj = {n: x @ f(p["qkv"][n]["weight"]) + f(p["qkv"][n].get("bias", 0.0)) for n in "qkv"}
    if qk_norm_over == "projection":  # OLMo 2: before the split into heads
        proj["q"] = ref_rms(proj["q"], p["q_norm"]["scale"])
        proj["k"] = ref_rms(proj["k"], p["k_norm"]["scale"])
    q = proj["q"].reshape(b, s, H, -1)
    k, v = (proj[n].reshape(b, s, kv_heads, -1) for n in "kv")
    if qk_norm_over == "head_dim":  # Qwen3: per head, one scale shared by the heads
        q, k = ref_rms(q, p["q_norm"]["scale"]), ref_rms(k, p["k_norm"]["scale"])
    if rope:  # after the norms
        q, k = (ref_rotary(t, pos) for t in (q, k))
    k, v = (np.repeat(t, H // kv_heads, axis=2) for t in (k, v))
    logits = np.einsum("bqhd,bkhd->bhqk", q, k) * (scale or 1.0 / math.sqrt(q.shape[-1]))
    if softcap is not None:
        logits = softcap * np.tanh(logits / softcap)
    allowed = pos[:, None, None, :] <= pos[:, None, :, None]
    logits = np.where(allowed, logits, -np.inf)
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    return np.einsum("bhqk,bkhd->bqhd", probs, v).reshape(b, s, -1) @ f(p["output"]["weight"])


def randomized(params, seed: int = 7):
    """`params` plus small random values everywhere (zero biases, unit scales matter then),
    added in numpy and placed with `device_put`."""
    leaves, treedef = jax.tree.flatten(params)
    return treedef.unflatten(
        [
            jax.device_put(np.asarray(a) + 0.3 * normal(seed + i, a.shape))
            for i, a in enumerate(leaves)
        ]
    )


def test_gqa_keeps_the_qkv_bias_of_the_projection_it_replaces():
    cfg = attention_cfg(qkv=QKVLinear.default_config().set(bias=True))
    cfg = make_modifier("gqa:num_kv_heads=2")(cfg)
    assert cfg.qkv.klass is GroupedQKVLinear and cfg.qkv.bias is True
    m, params = build(cfg)
    assert params["qkv"]["q"]["bias"].shape == (D,)
    assert params["qkv"]["k"]["bias"].shape == params["qkv"]["v"]["bias"].shape == (2 * D // H,)
    assert set(params["output"]) == {"weight"}
    params = randomized(params)
    x = normal(1, (B, S, D))
    out = run(m, params, {"x": x, "positions": arange_positions()})
    assert_close(out, ref_gqa_attention(x, params, 2))


@pytest.mark.parametrize("over", ["head_dim", "projection"])
def test_qk_norm_with_gqa_and_rope_matches_a_plain_reference_and_decodes(over):
    cfg = attention_cfg("gqa:num_kv_heads=2", "rope", qk_norm=RMSNorm.default_config())
    cfg.qk_norm_over = over
    m, params = build(cfg)
    d = D // H
    assert params["q_norm"]["scale"].shape == ((d,) if over == "head_dim" else (H * d,))
    assert params["k_norm"]["scale"].shape == ((d,) if over == "head_dim" else (2 * d,))
    params = randomized(params)
    x = normal(1, (B, S, D))
    positions = arange_positions() + 3
    full = run(m, params, {"x": x, "positions": positions})
    want = ref_gqa_attention(x, params, 2, positions=positions, qk_norm_over=over, rope=True)
    assert_close(full, want, F32_LOOSE)
    decoded = decode_in_chunks(m, params, x, positions, [3] + [1] * (S - 3), max_len=S + 2)
    assert_close(decoded, full, F32_LOOSE)


@pytest.mark.parametrize("flash", [False, True], ids=["core_kernel", "flash"])
def test_softcap_and_scale_with_gqa_and_rope_match_a_plain_reference_and_decode(flash):
    cfg = attention_cfg("gqa:num_kv_heads=2", "rope", logit_softcap=0.5)
    cfg.kernel.set(scale=0.4)
    if flash:
        cfg = make_modifier("flash_attention")(cfg)
        assert cfg.kernel.klass is FlashAttention and cfg.kernel.scale == 0.4
    m, params = build(cfg)
    x = 2.0 * normal(1, (B, S, D))
    positions = arange_positions() + 3
    full = run(m, params, {"x": x, "positions": positions})
    want = ref_gqa_attention(x, params, 2, positions=positions, rope=True, softcap=0.5, scale=0.4)
    assert_close(full, want, F32_LOOSE)
    uncapped = ref_gqa_attention(x, params, 2, positions=positions, rope=True, scale=0.4)
    assert not np.allclose(want, uncapped, rtol=1e-3, atol=1e-3)
    decoded = decode_in_chunks(m, params, x, positions, [3] + [1] * (S - 3), max_len=S + 2)
    assert_close(decoded, full, F32_LOOSE)
    paged = make_modifier("paged_kv_cache:page_size=4")(cfg)
    m_paged, _ = build(paged)
    decoded = decode_in_chunks(m_paged, params, x, positions, [3] + [1] * (S - 3), max_len=S + 2)
    assert_close(decoded, full, F32_LOOSE)


def test_gqa_rejects_a_kv_head_count_that_does_not_divide():
    with pytest.raises(ConfigError, match="num_kv_heads=3 must divide num_heads=4"):
        attention_cfg("gqa:num_kv_heads=3")
    cfg = attention_cfg()
    cfg.qkv = GroupedQKVLinear.default_config().set(num_kv_heads=3)
    with pytest.raises(ConfigError, match=r"model\.qkv\.num_kv_heads: 3 must divide num_heads"):
        build(cfg)


# ------------------------------------------------------------------------------ masks


def test_masks_compose_the_same_in_flash_and_core_attention():
    mods = ("rope", "gqa:num_kv_heads=2", "sliding_window:size=3")
    core, params = build(attention_cfg(*mods))
    flash, _ = build(attention_cfg(*mods, "flash_attention"))
    assert core.config.sliding_window == 3 and isinstance(flash.kernel, FlashAttention)
    inputs = {
        "x": normal(1, (B, S, D)),
        "positions": np.array([[0, 1, 2, 3, 4, 5, 0, 1], [0, 1, 2, 0, 1, 2, 3, 4]], np.int32),
        "segment_ids": np.array([[0, 0, 0, 0, 0, 0, 1, 1], [4, 4, 4, 5, 5, 5, 5, 5]], np.int32),
    }
    out = np.asarray(run(flash, params, inputs))
    assert_close(out, run(core, params, inputs))
    # The window hides token 0 from token 3 of the first row.
    x2 = inputs["x"].copy()
    x2[0, 0] = normal(2, (D,))
    out2 = np.asarray(run(flash, params, {**inputs, "x": x2}))
    assert_close(out2[0, 3:], out[0, 3:])
    assert not np.allclose(out2[0, 1:3], out[0, 1:3])


# ---------------------------------------------------------------------------------- ALiBi


def test_alibi_slopes_are_the_papers():
    from axplug_attention.alibi import alibi_slopes

    assert alibi_slopes(8) == tuple(2.0**-i for i in range(1, 9))
    # 6 heads: the 4-head slopes, then every other slope of 8 heads (the reference code).
    assert alibi_slopes(6) == (0.25, 0.0625, 0.015625, 0.00390625, 0.5, 0.125)
    assert alibi_slopes(4, max_bias=4.0) == (0.5, 0.25, 0.125, 0.0625)


def ref_alibi_attention(x, params, slopes, positions):
    """ALiBi self-attention in numpy from the layer's weights, written from the paper."""
    x = np.asarray(x, np.float64)
    w = {n: np.asarray(params["qkv"][n]["weight"], np.float64) for n in "qkv"}
    b, s, _ = x.shape
    hd = D // H
    q, k, v = ((x @ w[n]).reshape(b, s, H, hd) for n in "qkv")
    out = np.zeros((b, s, H, hd))
    for bi in range(b):
        pos = np.asarray(positions[bi])
        for h in range(H):
            scores = q[bi, :, h] @ k[bi, :, h].T / np.sqrt(hd)
            scores -= slopes[h] * np.abs(pos[:, None] - pos[None, :])
            scores = np.where(pos[None, :] <= pos[:, None], scores, -np.inf)
            p = np.exp(scores - scores.max(-1, keepdims=True))
            out[bi, :, h] = (p / p.sum(-1, keepdims=True)) @ v[bi, :, h]
    return out.reshape(b, s, D) @ np.asarray(params["output"]["weight"], np.float64)


@pytest.mark.parametrize("flash", [False, True], ids=["core_kernel", "flash_dispatch"])
def test_alibi_attention_matches_a_numpy_reference(flash):
    from axplug_attention.alibi import alibi_slopes

    cfg = attention_cfg("alibi", *(["flash_attention"] if flash else []))
    assert cfg.linear_bias_slopes == alibi_slopes(H)
    m, params = build(cfg)
    x, positions = normal(1, (B, S, D)), arange_positions() + 5
    out = run(m, params, {"x": x, "positions": positions})
    assert_close(out, ref_alibi_attention(x, params, alibi_slopes(H), positions), F32_LOOSE)
    # The bias moves the output: without it the layer computes something else.
    off = build(attention_cfg("alibi:max_bias=0"))[0]
    assert not np.allclose(run(off, params, {"x": x, "positions": positions}), out, atol=1e-3)


def test_alibi_keeps_the_bias_kernels_selectable():
    # Dispatch with the simulated backends: cuDNN stays chosen on CUDA for an ALiBi mask;
    # Splash (TPU) declines it, so TPU runs the XLA kernel (exact, any sharding).
    pytest.importorskip("axplug_gpu")
    pytest.importorskip("axplug_tpu")
    from axplug_attention.alibi import alibi_slopes

    from axplug.api import AttentionMask
    from axplug.api.kernels import select_kernel

    q = jax.ShapeDtypeStruct((1, 512, 8, 128), jnp.bfloat16)
    pos = jax.ShapeDtypeStruct((1, 512), jnp.int32)
    mask = AttentionMask(pos, pos, linear_bias_slopes=jnp.asarray(alibi_slopes(8)))
    assert select_kernel(q, q, q, mask, backend="cuda")[0] == "cudnn_flash"
    assert select_kernel(q, q, q, mask, backend="tpu")[0] == "xla"
    plain = AttentionMask(pos, pos)
    assert select_kernel(q, q, q, plain, backend="tpu")[0] == "splash"


def test_alibi_errors_name_the_field():
    with pytest.raises(ConfigError, match="alibi': max_bias=-1.0 must be >= 0"):
        make_modifier("alibi:max_bias=-1")(attention_cfg())
    with pytest.raises(ConfigError, match="linear_bias_slopes: 2 slopes for 4 heads"):
        attention_cfg(linear_bias_slopes=(0.5, 0.25)).instantiate(parent=None)


# ------------------------------------------------------------------------------ KV cache


def decode_in_chunks(m, params, x, positions, chunks, max_len):
    """Outputs of `extend_step` over consecutive chunks of x (the first one is the prefill)."""

    @jax.jit
    def step(params, x, positions, cache):
        return run(
            m, params, {"x": x, "positions": positions, "cache_state": cache}, method="extend_step"
        )

    cache = m.init_cache_state(x.shape[0], max_len)
    outs, start = [], 0
    for size in chunks:
        out, cache = step(
            params, x[:, start : start + size], positions[:, start : start + size], cache
        )
        outs.append(np.asarray(out))
        start += size
    assert (np.asarray(cache["length"]) == start).all()
    return np.concatenate(outs, axis=1)


@pytest.mark.parametrize(
    "mods",
    [
        (),
        ("rope", "gqa:num_kv_heads=2"),
        ("rope", "gqa:num_kv_heads=1", "sliding_window:size=3", "flash_attention"),
        ("alibi", "gqa:num_kv_heads=2"),
        ("alibi", "sliding_window:size=3", "flash_attention"),
    ],
    ids=["plain", "rope_gqa", "rope_mqa_window_flash", "alibi_gqa", "alibi_window_flash"],
)
def test_token_by_token_decode_matches_forward(mods):
    m, params = build(attention_cfg(*mods))
    x = normal(1, (B, S, D))
    positions = arange_positions() + 3  # decoding from an offset works too
    full = run(m, params, {"x": x, "positions": positions})
    decoded = decode_in_chunks(m, params, x, positions, [3] + [1] * (S - 3), max_len=S + 2)
    assert_close(decoded, full, F32_LOOSE)


def test_cache_state_shapes_and_dtype():
    m, _ = build(attention_cfg("gqa:num_kv_heads=2"))
    cache = m.init_cache_state(3, 16)
    assert cache["key"].shape == cache["value"].shape == (2, 3, 16, D // H)  # kv heads first
    assert cache["key"].dtype == jnp.float32 and cache["positions"].shape == (3, 16)
    assert cache["length"].shape == (3,) and not np.asarray(cache["length"]).any()


def test_decoding_needs_causal_attention():
    m, params = build(attention_cfg(causal=False))
    with pytest.raises(ConfigError, match="decoding with a KV cache needs causal attention"):
        run(
            m,
            params,
            {
                "x": normal(1, (1, 1, D)),
                "positions": np.zeros((1, 1), np.int32),
                "cache_state": m.init_cache_state(1, 4),
            },
            method="extend_step",
        )


def small_lm_cfg(*modifiers, layers=2):
    cfg = CausalLM.default_config()
    cfg.decoder.set(vocab_size=50, dim=D)
    cfg.decoder.transformer.set(num_layers=layers)
    cfg.decoder.transformer.layer.attention.set(num_heads=H)
    cfg.decoder.transformer.layer.feed_forward.set(hidden_dim=64)
    for spec in modifiers:
        cfg = make_modifier(spec)(cfg)
    return cfg


def model_decode_logits(model, params, ids, chunks, max_len):
    """Logits of a StackedTransformer CausalLM run chunk by chunk through the KV caches."""
    dec = model.decoder
    layers = [getattr(dec.transformer, f"layer{i}") for i in range(len(dec.transformer.children))]

    @jax.jit
    def step(params, ids, positions, caches):
        p = params["decoder"]
        x = run(dec.embedding, p["embedding"], (ids,))
        new_caches = []
        for i, layer in enumerate(layers):
            lp = p["transformer"][f"layer{i}"]
            h = run(layer.attention_norm, lp["attention_norm"], (x,))
            h, cache = run(
                layer.attention,
                lp["attention"],
                {"x": h, "positions": positions, "cache_state": caches[i]},
                method="extend_step",
            )
            new_caches.append(cache)
            x = x + h
            h = run(layer.feed_forward_norm, lp["feed_forward_norm"], (x,))
            x = x + run(layer.feed_forward, lp["feed_forward"], (h,))
        x = run(dec.output_norm, p["output_norm"], (x,))
        return run(dec.lm_head, p["lm_head"], (x,)), new_caches

    caches = [layer.attention.init_cache_state(ids.shape[0], max_len) for layer in layers]
    positions = arange_positions(*ids.shape)
    logits, start = [], 0
    for size in chunks:
        out, caches = step(
            params, ids[:, start : start + size], positions[:, start : start + size], caches
        )
        logits.append(np.asarray(out))
        start += size
    return np.concatenate(logits, axis=1)


@pytest.mark.parametrize(
    "mods",
    [("rope:theta=500000", "gqa:num_kv_heads=2", "flash_attention"), ("alibi", "flash_attention")],
    ids=["rope_gqa_flash", "alibi_flash"],
)
def test_model_decode_logits_match_the_full_forward(mods):
    model, params = build(small_lm_cfg(*mods))
    ids = np.random.default_rng(0).integers(0, 50, (B, S)).astype(np.int32)
    full = run(model, params, (ids,), method="predict")
    decoded = model_decode_logits(model, params, ids, [4] + [1] * (S - 4), max_len=S)
    assert_close(decoded, full, F32_LOOSE)


# ----------------------------------------------------------------------------- modifiers


def attention_paths(cfg, cls):
    from axplug.api.config import find_configs

    return [path for path, _ in find_configs(cfg, cls)]


def two_attention_tree():
    """A tree that is no decoder at all: two attention configs side by side in a list."""
    from axplug.api.config import ChainConfigModifier

    cfg = ChainConfigModifier.default_config()
    cfg.modifiers = [Attention.default_config().set(num_heads=4) for _ in range(2)]
    return cfg


@pytest.mark.parametrize("tree", ["stacked", "scanned", "llama_tiny_trainer", "list"])
def test_modifiers_reach_every_attention_in_any_tree(tree):
    cfg = {
        "stacked": small_lm_cfg,
        "scanned": lambda: small_lm_cfg("scan_layers"),
        "llama_tiny_trainer": lambda: preset_config("llama-tiny"),
        "list": two_attention_tree,
    }[tree]()
    paths = attention_paths(cfg, Attention)
    new = cfg
    for spec in ("gqa:num_kv_heads=2", "flash_attention", "rope", "sliding_window:size=5"):
        new = make_modifier(spec)(new)
    assert attention_paths(new, Attention) == paths and paths
    for old in (QKVLinear, IdentityPositionTransform, DotProductKernel):
        assert attention_paths(new, old) == []
    slots = (
        (GroupedQKVLinear, "qkv"),
        (RotaryPositionTransform, "position"),
        (FlashAttention, "kernel"),
    )
    for cls, slot in slots:
        assert attention_paths(new, cls) == [f"{p}.{slot}" for p in paths]
    from axplug.api.config import find_configs

    assert all(a.sliding_window == 5 for _, a in find_configs(new, Attention))


def test_modifiers_never_mutate_their_input_and_reapply_as_updates():
    cfg = preset_config("llama-tiny")  # the preset already applies `rope`
    before = cfg.debug_string()
    new = make_modifier("rope:theta=500000")(make_modifier("gqa:num_kv_heads=4")(cfg))
    new = make_modifier("gqa:num_kv_heads=2")(new)
    assert cfg.debug_string() == before
    attention = new.model.decoder.transformer.layer.attention
    assert attention.position.theta == 500000.0 and isinstance(attention.position.theta, float)
    assert attention.qkv.num_kv_heads == 2
    assert attention.qkv.klass is GroupedQKVLinear


def test_modifier_errors():
    no_attention = RepeatedTransformer.default_config()
    no_attention.layer = QKVLinear.default_config()
    with pytest.raises(ConfigError, match="modifier 'rope': the config has no"):
        make_modifier("rope")(no_attention)
    with pytest.raises(ConfigError, match="sliding_window': size=0 must be >= 1"):
        make_modifier("sliding_window:size=0")(small_lm_cfg())
    with pytest.raises(ConfigError, match="modifier 'rope': .*unknown field"):
        make_modifier("rope:thetta=1")


SWAPS = {
    "alibi": "attention.linear_bias_slopes: (0.5, 0.25, 0.125, 0.0625, 0.03125, 0.015625, "
    "0.0078125, 0.00390625)",  # llama-tiny's 8 heads
    "rope:theta=500000": "attention.position.theta: 500000.0",
    "gqa:num_kv_heads=2": "attention.qkv.klass: axplug_attention.gqa:GroupedQKVLinear",
    "flash_attention": "attention.kernel.klass: axplug.layers.flash:FlashAttention",
    "sliding_window:size=8": "attention.sliding_window: 8",
}


def tiny_llama(tmp_path, *modifiers, steps=6):
    return tiny_trainer_config(
        tmp_path,
        "model.decoder.transformer.num_layers=1",
        "learner.warmup_steps=0",
        "learner.learning_rate=1e-2",
        preset="llama-tiny",
        modifiers=modifiers,
        max_steps=steps,
    )


def train_losses(cfg):
    """The losses of `max_steps` calls of the built train step (no run: nothing of a run's
    checkpoints, writers or hooks is the claim)."""
    _, metrics = train_steps(cfg.instantiate(devices=jax.devices()[:1]), cfg.max_steps)
    return [float(m["loss"]) for m in metrics]


def test_llama_tiny_with_every_modifier_trains(tmp_path):
    cfg = tiny_llama(tmp_path, *SWAPS)
    text = cfg.debug_string()
    assert "layer.attention.position.klass: axplug_attention.rope:RotaryPositionTransform" in text
    for line in SWAPS.values():
        assert f"model.decoder.transformer.layer.{line}" in text
    losses = train_losses(cfg)
    assert len(losses) == 6 and all(map(math.isfinite, losses))
    assert losses[-1] < losses[0] - 0.5, losses


@pytest.mark.slow
@pytest.mark.parametrize("spec", list(SWAPS))
def test_llama_tiny_with_one_modifier_trains(tmp_path, spec):
    cfg = tiny_llama(tmp_path, spec)
    assert f"model.decoder.transformer.layer.{SWAPS[spec]}" in cfg.debug_string()
    losses = train_losses(cfg)
    assert losses[-1] < losses[0] - 0.5, losses


@pytest.mark.parametrize("spec", list(SWAPS))
def test_each_modifier_shows_its_swap_in_debug_string(spec):
    base = preset_config("llama-tiny").debug_string().splitlines()
    new = preset_config("llama-tiny", modifiers=[spec]).debug_string().splitlines()
    added = set(new) - set(base)
    assert f"model.decoder.transformer.layer.{SWAPS[spec]}" in added


# ------------------------------------------------------------------------------ sharding


def test_tensor_parallel_on_8_devices_matches_one_device():
    assert jax.device_count() == 8, "the root conftest.py sets 8 fake CPU devices"
    model, params = build(small_lm_cfg("rope", "gqa:num_kv_heads=2", "flash_attention"))
    specs = model.create_parameter_specs_recursively()
    attention_specs = specs["decoder"]["transformer"]["layer0"]["attention"]
    assert attention_specs["qkv"]["k"]["weight"].mesh_axes == ("embed", "heads")
    assert attention_specs["output"]["weight"].mesh_axes == ("heads", "embed")
    ids = np.random.default_rng(0).integers(0, 50, (B, S)).astype(np.int32)

    def loss(params, ids):
        (value, _), _ = functional(
            model, prng_key=None, state=params, inputs=(ids, ids), is_training=False
        )
        return value

    grad_fn = jax.value_and_grad(loss)
    want_loss, want_grads = jax.jit(grad_fn)(params, ids)  # params live on one device

    mesh = MeshBuilder.default_config().set(mesh_shape=(2, 1, 1, 1, 4)).instantiate().build()
    shardings = parameter_shardings(specs, mesh, DEFAULT_AXIS_RULES)
    sharded = jax.device_put(params, shardings)
    q_sharding = sharded["decoder"]["transformer"]["layer0"]["attention"]["qkv"]["q"]["weight"]
    assert q_sharding.sharding.spec[1] == "model" and len(q_sharding.sharding.device_set) == 8
    ids_sharded = jax.device_put(
        ids, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
    )
    got_loss, got_grads = jax.jit(grad_fn)(sharded, ids_sharded)
    assert_close(got_loss, want_loss, F32_LOOSE)
    jax.tree.map(lambda g, w: assert_close(g, w, F32_LOOSE), got_grads, want_grads)


# --------------------------------------------------------------- the conformance kit

from axplug_testing import LayerConformance, tiny_trainer_config, train_steps  # noqa: E402


class TestRopeGqaAttentionConformance(LayerConformance):
    """The kit on Attention with RoPE and 2 kv heads, swapped for llama-tiny's attention."""

    @pytest.fixture
    def layer_config(self):
        return attention_cfg("rope", "gqa:num_kv_heads=2")

    @pytest.fixture
    def inputs(self):
        return {"x": normal(0, (4, S, D)), "positions": arange_positions(4)}

    @pytest.fixture
    def swap_target(self):
        return Attention


@pytest.mark.parametrize(
    "given, field, default",
    [
        ("rope:theta=500000", lambda a: a.position.theta, 10000.0),
        ("rope:linear_scaling_factor=8", lambda a: a.position.linear_scaling_factor, None),
        ("gqa:num_kv_heads=2", lambda a: a.qkv.num_kv_heads, 1),
        ("sliding_window:size=8", lambda a: a.sliding_window, 4096),
        ("alibi:max_bias=4", lambda a: a.linear_bias_slopes[0], 2.0**-1),  # 8 heads, bias 8
    ],
    ids=["rope", "rope_linear", "gqa", "sliding_window", "alibi"],
)
def test_reapplying_a_modifier_resets_the_options_it_owns(given, field, default):
    # The documented rule: applied again, a modifier sets every option it owns, given or
    # default (llama3-style theta back to 10000 when `rope` comes again without it).
    name = given.split(":")[0]
    cfg = make_modifier(given)(preset_config("llama-tiny"))
    attention = cfg.model.decoder.transformer.layer.attention
    assert field(attention) != default
    again = make_modifier(name)(cfg).model.decoder.transformer.layer.attention
    assert field(again) == default


class TestMultiHeadLatentAttentionConformance(LayerConformance):
    """The kit on MLA (q compressed), swapped for llama-tiny's whole attention layer."""

    @pytest.fixture
    def layer_config(self):
        from axplug_attention.mla import MultiHeadLatentAttention

        return MultiHeadLatentAttention.default_config().set(
            input_dim=D, num_heads=4, q_lora_rank=12, kv_lora_rank=16, qk_nope_head_dim=8,
            qk_rope_head_dim=8, v_head_dim=12,
        )  # fmt: skip

    @pytest.fixture
    def inputs(self):
        return {"x": normal(0, (4, S, D)), "positions": arange_positions(4)}

    @pytest.fixture
    def swap_target(self):
        return Attention
