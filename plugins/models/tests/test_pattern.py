"""PatternedTransformer: layers that differ by kind (Gemma 2 / Gemma 3 attention patterns).

Numerics against a plain-numpy transformer run layer by layer with each layer's own settings,
KV-cache decoding against the forward pass, the parameter tree against StackedTransformer's,
the config round trip, the errors, and the Hugging Face fields against transformers' own
Gemma 2 / Gemma 3 configs (layer_types, windows, per-kind RoPE frequencies).

Tolerances: float32 layer stacks 1e-5; whole models decoded token by token 1e-4.
"""

from __future__ import annotations

import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from axplug_attention import GroupedQKVLinear, RotaryPositionTransform, rope_frequencies
from axplug_models.pattern import PatternedTransformer, apply_layer_overrides

from axplug.api import EMPTY_POSITION, HFFields
from axplug.api.config import ConfigError, from_dict, make_modifier, replace_config, to_dict
from axplug.api.interop import read_fields, write_fields
from axplug.api.layers import CausalLM, StackedTransformer, TransformerLayer, functional

F32 = dict(rtol=1e-5, atol=1e-5)
LOOSE = dict(rtol=1e-4, atol=1e-4)
DIM, HEADS, HIDDEN, VOCAB = 32, 4, 64, 61
HEAD_DIM = DIM // HEADS

# Gemma 3 in small: local layers with a window of 3 and theta 10000, every third layer global
# with theta 1e6 and linear RoPE scaling 4 (the template's).
GEMMA3_LIKE = dict(
    pattern=("local", "local", "global", "local", "local"),
    kinds={
        "local": {
            "attention.sliding_window": 3,
            "attention.position.theta": 10000.0,
            "attention.position.linear_scaling_factor": None,
        },
        "global": {},
    },
)
# What each layer of GEMMA3_LIKE is, spelled without the override machinery.
LOCAL = (3, 10000.0, None)  # (window, theta, linear RoPE factor)
GEMMA3_LAYERS = [LOCAL, LOCAL, (None, 1e6, 4.0), LOCAL, LOCAL]


def template() -> TransformerLayer.Config:
    layer = TransformerLayer.default_config()
    layer.attention.set(num_heads=HEADS)
    layer.attention.position = RotaryPositionTransform.default_config().set(
        theta=1e6, linear_scaling_factor=4.0
    )
    layer.feed_forward.set(hidden_dim=HIDDEN)
    return layer


def stack_cfg(pattern, kinds, layer=None) -> PatternedTransformer.Config:
    return PatternedTransformer.default_config().set(
        input_dim=DIM,
        num_layers=len(pattern),
        pattern=tuple(pattern),
        kinds=kinds,
        layer=layer or template(),
    )


def build(cfg, seed: int = 0):
    model = cfg.instantiate(parent=None)
    return model, model.initialize_parameters_recursively(jax.random.PRNGKey(seed))


def call(model, params, inputs, method="forward"):
    out, _ = functional(
        model, prng_key=None, state=params, inputs=inputs, is_training=False, method=method
    )
    return out


def jit_call(model, params, inputs, method="forward"):
    """`call` as one compiled program, not one per op."""
    return jax.jit(lambda p, i: call(model, p, i, method))(params, inputs)


def normal(seed: int, shape) -> jax.Array:
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), jnp.float32)


def positions(batch: int, seq: int) -> np.ndarray:
    # numpy: an eager jnp iota and broadcast would each compile a program per shape.
    return np.broadcast_to(np.arange(seq, dtype=np.int32), (batch, seq))


# --- a plain-numpy reference -------------------------------------------------------------------
# numpy, float64: nothing to compile (a jnp reference compiles a program of its own).


def ref_rms(x, scale, eps=1e-6):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * scale


def ref_rope(x, pos, theta, linear):
    """Rotate-half RoPE: pairs (i, i + d/2), angle pos / linear * theta^(-2i/d)."""
    d = x.shape[-1]
    freqs = 1.0 / theta ** (np.arange(0, d, 2) / d)
    if linear is not None:
        freqs = freqs / linear
    angle = pos[..., None, None].astype(np.float64) * freqs  # [b, s, 1, d/2]
    cos, sin = np.cos(angle), np.sin(angle)
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def ref_softmax(x):
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def ref_layer(p, x, pos, window, theta, linear):
    """One pre-norm layer: x + attention(rms(x)), then x + swiglu(rms(x))."""
    p = jax.tree.map(lambda a: np.asarray(a, np.float64), p)
    a = p["attention"]
    h = ref_rms(x, p["attention_norm"]["scale"])
    split = lambda t: t.reshape(*t.shape[:2], HEADS, HEAD_DIM)  # noqa: E731
    q, k, v = (split(h @ a["qkv"][n]["weight"]) for n in "qkv")
    q, k = ref_rope(q, pos, theta, linear), ref_rope(k, pos, theta, linear)
    scores = np.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(HEAD_DIM)
    qp, kp = pos[:, None, :, None], pos[:, None, None, :]
    allowed = kp <= qp
    if window is not None:
        allowed &= qp - kp < window
    probs = ref_softmax(np.where(allowed, scores, -np.inf))
    out = np.einsum("bhqk,bkhd->bqhd", probs, v).reshape(x.shape)
    x = x + out @ a["output"]["weight"]
    f = p["feed_forward"]
    h = ref_rms(x, p["feed_forward_norm"]["scale"])
    gate = h @ f["wi_gate"]["weight"]
    return x + (gate / (1.0 + np.exp(-gate)) * (h @ f["wi_up"]["weight"])) @ f["wo"]["weight"]


def test_forward_equals_a_plain_numpy_reference_with_each_layers_own_settings():
    model, params = build(stack_cfg(**GEMMA3_LIKE))
    x, pos = normal(1, (2, 9, DIM)), positions(2, 9)
    got = jit_call(model, params, {"x": x, "positions": pos})
    want = np.asarray(x, np.float64)
    for i, (window, theta, linear) in enumerate(GEMMA3_LAYERS):
        want = ref_layer(params[f"layer{i}"], want, np.asarray(pos), window, theta, linear)
    np.testing.assert_allclose(got, want, **F32)
    # ...and the pattern matters: one kind for every layer computes something else.
    uniform = stack_cfg(["global"] * 5, GEMMA3_LIKE["kinds"]).instantiate(parent=None)
    other = jit_call(uniform, params, {"x": x, "positions": pos})
    assert float(np.max(np.abs(np.asarray(other) - np.asarray(got)))) > 1e-3


def test_each_layer_equals_a_layer_built_alone_from_its_own_config():
    model, params = build(stack_cfg(**GEMMA3_LIKE))
    x, pos = normal(2, (2, 7, DIM)), positions(2, 7)
    got = jit_call(model, params, {"x": x, "positions": pos})
    want = x
    for i, (window, theta, linear) in enumerate(GEMMA3_LAYERS):
        own = template().set(input_dim=DIM)
        own.attention.sliding_window = window
        own.attention.position.set(theta=theta, linear_scaling_factor=linear)
        assert to_dict(model.layer_config(i).set(input_dim=DIM)) == to_dict(own)
        layer = own.instantiate(parent=None)
        want = jit_call(layer, params[f"layer{i}"], {"x": want, "positions": pos})
    np.testing.assert_allclose(got, want, **F32)


# --- decoding -----------------------------------------------------------------------------------


def lm(*modifiers: str):
    cfg = CausalLM.default_config()
    cfg.decoder.set(vocab_size=VOCAB, dim=DIM)
    cfg.decoder.transformer = stack_cfg(**GEMMA3_LIKE)
    cfg.decoder.transformer.layer.attention.qkv = GroupedQKVLinear.default_config().set(
        num_kv_heads=2
    )
    for spec in modifiers:
        cfg = make_modifier(spec)(cfg)
    return cfg


def decode_logits(model, params, ids, prompt_lens, max_len):
    """A batched prefill of each row's first prompt_lens[b] tokens, then one token a call."""
    batch, total = ids.shape
    step = jax.jit(
        lambda p, i, pos, c: call(
            model, p, {"input_ids": i, "positions": pos, "cache_state": c}, "extend_step"
        )
    )
    cache = model.init_cache_state(batch, max_len)
    width = max(prompt_lens)
    pos = np.full((batch, width), EMPTY_POSITION, np.int32)
    prefill = np.zeros((batch, width), np.int32)
    for b, n in enumerate(prompt_lens):
        pos[b, :n], prefill[b, :n] = np.arange(n), ids[b, :n]
    logits, cache = step(params, prefill, pos, cache)
    logits = np.asarray(logits)  # read on the host: no program per slice
    out = np.zeros((batch, total, VOCAB), np.float32)
    for b, n in enumerate(prompt_lens):
        out[b, :n] = logits[b, :n]
    for t in range(min(prompt_lens), total):
        p = np.where(np.asarray(prompt_lens) <= t, t, EMPTY_POSITION)[:, None].astype(np.int32)
        logits, cache = step(params, ids[:, t : t + 1], p, cache)
        logits = np.asarray(logits)
        for b, n in enumerate(prompt_lens):
            if t >= n:
                out[b, t] = logits[b, 0]
    return out, cache


@pytest.mark.parametrize("mods", [(), ("paged_kv_cache:page_size=4",)], ids=["contiguous", "paged"])
def test_decoding_with_the_cache_gives_the_forward_logits(mods):
    model, params = build(lm(*mods))
    ids = np.random.default_rng(3).integers(0, VOCAB, (3, 11)).astype(np.int32)
    full = np.asarray(
        jax.jit(lambda p, i: call(model, p, (i,), "predict"))(params, jnp.asarray(ids))
    )
    decoded, cache = decode_logits(model, params, ids, prompt_lens=[5, 2, 7], max_len=12)
    np.testing.assert_allclose(decoded, full, **LOOSE)
    assert sorted(cache["transformer"]) == [f"layer{i}" for i in range(5)]


# --- structure ----------------------------------------------------------------------------------


def test_parameter_tree_equals_stacked_transformers():
    patterned, p_params = build(stack_cfg(**GEMMA3_LIKE))
    plain = StackedTransformer.default_config().set(input_dim=DIM, num_layers=5, layer=template())
    stacked, s_params = build(plain)
    shape = lambda t: jax.tree.map(lambda a: (a.shape, a.dtype), t)  # noqa: E731
    assert shape(p_params) == shape(s_params)
    assert jax.tree.structure(patterned.create_parameter_specs_recursively()) == jax.tree.structure(
        stacked.create_parameter_specs_recursively()
    )
    # Children are named like StackedTransformer's, so initialization is the same too.
    jax.tree.map(np.testing.assert_array_equal, p_params, s_params)


def test_config_round_trips_through_to_dict_and_json():
    cfg = stack_cfg(**GEMMA3_LIKE)
    data = json.loads(json.dumps(to_dict(cfg)))
    again = from_dict(data)
    assert isinstance(again, PatternedTransformer.Config)
    assert again.pattern == GEMMA3_LIKE["pattern"] and again.kinds == GEMMA3_LIKE["kinds"]
    assert to_dict(again) == to_dict(cfg)
    model = again.instantiate(parent=None)
    assert [model.layer_config(i).attention.sliding_window for i in range(5)] == [3, 3, None, 3, 3]


def test_unused_kinds_are_allowed_and_checked():
    kinds = {**GEMMA3_LIKE["kinds"], "spare": {"attention.sliding_windw": 2}}
    with pytest.raises(ConfigError, match=r"kinds\['spare'\]\['attention.sliding_windw'\]"):
        build(stack_cfg(GEMMA3_LIKE["pattern"], kinds))
    build(stack_cfg(GEMMA3_LIKE["pattern"], {**GEMMA3_LIKE["kinds"], "spare": {}}))


# --- errors -------------------------------------------------------------------------------------


def test_a_pattern_of_the_wrong_length_is_an_error():
    cfg = stack_cfg(**GEMMA3_LIKE).set(num_layers=4)
    with pytest.raises(ConfigError, match=r"pattern: 5 kind\(s\) for num_layers=4"):
        cfg.instantiate(parent=None)


def test_an_unknown_kind_is_an_error_naming_the_known_ones():
    cfg = stack_cfg(("local", "glob"), GEMMA3_LIKE["kinds"])
    with pytest.raises(ConfigError) as info:
        cfg.instantiate(parent=None)
    message = str(info.value)
    assert "pattern: layer 1 has kind 'glob'" in message and "'local', 'global'" in message


def test_a_missing_pattern_is_a_required_field():
    cfg = PatternedTransformer.default_config().set(input_dim=DIM, num_layers=2)
    with pytest.raises(ConfigError, match="pattern: required field is not set"):
        cfg.instantiate(parent=None)


@pytest.mark.parametrize(
    "path, value, expected",
    [
        (
            "attention.sliding_windw",
            3,
            r"kinds\['local'\]\['attention.sliding_windw'\]: attention \(Attention.Config\) has "
            r"no field 'sliding_windw', did you mean 'sliding_window'\?",
        ),
        ("atention.sliding_window", 3, r"\['atention.sliding_window'\]: the layer config"),
        ("attention.num_heads.x", 3, r"attention.num_heads is 4, not a config"),
        ("attention.sliding_window", "wide", r"\['attention.sliding_window'\]: .*expected int"),
    ],
    ids=["typo", "typo_in_a_parent", "through_a_leaf", "wrong_type"],
)
def test_a_bad_override_names_its_config_path(path, value, expected):
    cfg = stack_cfg(("local", "global"), {"local": {path: value}, "global": {}})
    with pytest.raises(ConfigError, match=expected):
        cfg.instantiate(parent=None)


def test_overrides_leave_the_template_alone():
    layer = template()
    new = apply_layer_overrides(layer, {"attention.position.theta": 5.0}, "kinds['x']")
    assert new.attention.position.theta == 5.0 and layer.attention.position.theta == 1e6


# --- RoPE linear scaling ------------------------------------------------------------------------


def test_linear_rope_scaling_equals_transformers():
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = transformers.LlamaConfig(
        hidden_size=64,
        num_attention_heads=4,
        head_dim=16,
        rope_parameters={"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
    )
    inv_freq, scale = ROPE_INIT_FUNCTIONS["linear"](config, "cpu")
    ours = rope_frequencies(16, theta=1e6, linear_scaling_factor=8.0)
    np.testing.assert_allclose(ours, inv_freq.numpy(), rtol=1e-6)
    assert scale == 1.0


# --- Hugging Face -------------------------------------------------------------------------------


def hf_model(fields: HFFields):
    """A LLaMA-layout model config with the patterned stack, read from `fields`."""
    from axplug_attention.llama import llama_base

    cfg = llama_base(fields)
    cfg = replace_config(
        cfg,
        target=StackedTransformer,
        new_cfg=PatternedTransformer.default_config(),
        carry=["layer"],
    )
    read_fields(cfg.model, fields)
    return cfg.model


SHAPES = dict(
    vocab_size=96,
    hidden_size=32,
    intermediate_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    sliding_window=4,
)
OURS = {  # the fields this model reads (Gemma's own - soft-capping, norms - are not ours)
    "vocab_size", "hidden_size", "intermediate_size", "num_attention_heads",
    "num_key_value_heads", "head_dim", "sliding_window", "num_hidden_layers", "layer_types",
    "rope_parameters", "rope_theta", "rope_scaling", "rope_local_base_freq",
    "sliding_window_pattern", "rms_norm_eps", "tie_word_embeddings", "attention_bias",
    "attention_dropout",
}  # fmt: skip


def from_raw(raw: dict, **defaults):
    raw = {k: v for k, v in raw.items() if k in OURS}
    fields = HFFields(raw, defaults={"rms_norm_eps": 1e-6, **defaults})
    model = hf_model(fields)
    assert fields.problems == []
    assert fields.unread() == {}
    return model


def layers_of(model):
    stack = model.decoder.transformer
    built = stack.clone(input_dim=DIM).instantiate(parent=None)
    return [built.layer_config(i) for i in range(stack.num_layers)]


def test_gemma2_layer_types_and_window_equal_transformers():
    transformers = pytest.importorskip("transformers")
    hf = transformers.Gemma2Config(num_hidden_layers=5, **SHAPES)
    model = from_raw(hf.to_dict())
    stack = model.decoder.transformer
    assert stack.pattern == tuple(hf.layer_types)
    assert stack.kinds == {
        "sliding_attention": {"attention.sliding_window": 4},
        "full_attention": {"attention.sliding_window": None},
    }
    windows = [layer.attention.sliding_window for layer in layers_of(model)]
    assert windows == [4 if t == "sliding_attention" else None for t in hf.layer_types]
    assert {layer.attention.position.theta for layer in layers_of(model)} == {10000.0}


def test_absent_layer_types_derive_from_the_period_as_in_transformers():
    transformers = pytest.importorskip("transformers")
    raw = transformers.Gemma2Config(num_hidden_layers=5, **SHAPES).to_dict()
    want = raw.pop("layer_types")
    # Gemma 2's config.json may leave layer_types out; the family gives the period (2).
    assert from_raw(raw, sliding_window_pattern=2).decoder.transformer.pattern == tuple(want)
    three = transformers.Gemma3TextConfig(num_hidden_layers=13, sliding_window_pattern=3)
    raw = {**SHAPES, "num_hidden_layers": 13, "sliding_window_pattern": 3, "rope_theta": 1e6}
    assert from_raw(raw).decoder.transformer.pattern == tuple(three.layer_types)


def gemma3_rope(hf_config, layer_type: str) -> np.ndarray:
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RotaryEmbedding

    return getattr(Gemma3RotaryEmbedding(hf_config), f"{layer_type}_inv_freq").numpy()


def our_rope(layer) -> np.ndarray:
    position = layer.attention.position.clone(head_dim=layer.attention.head_dim)
    return position.instantiate(parent=None).frequencies(layer.attention.head_dim)


GEMMA3_LEGACY = dict(  # the transformers 4 form of the Hub's Gemma 3 config.json files
    SHAPES,
    num_hidden_layers=8,
    sliding_window_pattern=6,
    rope_theta=1e6,
    rope_local_base_freq=10000.0,
    rope_scaling={"rope_type": "linear", "factor": 8.0},
)


@pytest.mark.parametrize("form", ["transformers5", "legacy"])
def test_gemma3_layers_windows_and_rope_per_kind_equal_transformers(form):
    transformers = pytest.importorskip("transformers")
    hf = transformers.Gemma3TextConfig(**GEMMA3_LEGACY)
    raw = hf.to_dict() if form == "transformers5" else dict(GEMMA3_LEGACY)
    if form == "transformers5":
        assert set(raw["rope_parameters"]) == {"sliding_attention", "full_attention"}
    model = from_raw(raw)
    assert model.decoder.transformer.pattern == tuple(hf.layer_types)
    for kind, layer in zip(hf.layer_types, layers_of(model), strict=True):
        window = layer.attention.sliding_window
        assert window == (4 if kind == "sliding_attention" else None)
        np.testing.assert_allclose(our_rope(layer), gemma3_rope(hf, kind), rtol=1e-6)
    global_rope = model.decoder.transformer.layer.attention.position
    assert (global_rope.theta, global_rope.linear_scaling_factor) == (1e6, 8.0)


@pytest.mark.parametrize("period_field", ["sliding_window_pattern", "_sliding_window_pattern"])
def test_gemma3_family_derives_layer_types_from_either_period_name(period_field):
    """The Hub's Gemma 3 config.json files have no layer_types; the period is spelled without
    the underscore there and with it in transformers 5."""
    transformers = pytest.importorskip("transformers")
    from axplug.api.interop import hf_trainer_config, parse_hf_config

    hf = transformers.Gemma3TextConfig(**{**GEMMA3_LEGACY, "sliding_window_pattern": 3})
    raw = {k: v for k, v in GEMMA3_LEGACY.items() if k != "sliding_window_pattern"}
    raw = {
        "architectures": ["Gemma3ForCausalLM"],
        **raw,
        period_field: 3,
        "query_pre_attn_scalar": 8,
    }
    cfg = hf_trainer_config(parse_hf_config(raw), output_dir="unused")
    assert cfg.model.decoder.transformer.pattern == tuple(hf.layer_types)


def test_gemma3_export_writes_what_transformers_reads_back():
    transformers = pytest.importorskip("transformers")
    hf = transformers.Gemma3TextConfig(**GEMMA3_LEGACY)
    model = from_raw(hf.to_dict())
    written, problems = write_fields(model)
    assert problems == []
    assert written["layer_types"] == hf.layer_types
    assert written["sliding_window"] == 4 and written["rope_local_base_freq"] == 10000.0
    # The rotary fraction written even when whole (a family's default may be a part).
    whole = {kind: {**p, "partial_rotary_factor": 1.0} for kind, p in hf.rope_parameters.items()}
    assert written["rope_parameters"] == whole
    again = transformers.Gemma3TextConfig(**written)
    assert again.layer_types == hf.layer_types and again.rope_parameters == whole
    # ...and it reads back to the same model.
    assert to_dict(from_raw(written)) == to_dict(model)


def test_gemma2_export_writes_one_rope_and_reads_back():
    transformers = pytest.importorskip("transformers")
    hf = transformers.Gemma2Config(num_hidden_layers=3, **SHAPES)
    model = from_raw(hf.to_dict())
    written, problems = write_fields(model)
    assert problems == []
    assert written["layer_types"] == hf.layer_types and written["sliding_window"] == 4
    assert "rope_local_base_freq" not in written
    assert written["rope_parameters"] == {
        "rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 1.0
    }  # fmt: skip
    assert to_dict(from_raw(written)) == to_dict(model)


def test_a_hand_built_pattern_exports_with_the_window_in_the_kinds():
    """The template without a window, the sliding kind with one: config.json's one
    `sliding_window` is the sliding layers'."""
    layer = template()
    layer.attention.position.set(theta=10000.0, linear_scaling_factor=None)
    cfg = stack_cfg(
        ("sliding_attention", "full_attention"),
        {"sliding_attention": {"attention.sliding_window": 3}, "full_attention": {}},
        layer,
    )
    written = PatternedTransformer.hf_write(cfg)
    assert written["sliding_window"] == 3
    assert written["layer_types"] == ["sliding_attention", "full_attention"]


@pytest.mark.parametrize(
    "kinds, expected",
    [
        ({"local": {}, "full_attention": {}}, "kind 'local' is not a Hugging Face layer type"),
        (
            {"sliding_attention": {}, "full_attention": {}},
            "the sliding_attention layers have no sliding window",
        ),
        (
            {
                "sliding_attention": {"attention.sliding_window": 3},
                "full_attention": {"attention.sliding_window": 5},
            },
            r"the full_attention layers have a sliding window \(5\)",
        ),
        (
            {
                "sliding_attention": {"attention.sliding_window": 3},
                "full_attention": {"feed_forward.hidden_dim": 128},
            },
            "differ in intermediate_size",
        ),
        (
            {
                "sliding_attention": {"attention.sliding_window": 3, "feed_forward.gated": False},
                "full_attention": {},
            },
            r"cannot express .*feed_forward.gated: False \(config.json reads True\)",
        ),
        (
            {
                "sliding_attention": {
                    "attention.sliding_window": 3,
                    "attention.position.interleaved": True,
                },
                "full_attention": {},
            },
            "the sliding_attention layers: layer.attention.position: interleaved RoPE",
        ),
    ],
    ids=[
        "kind_name",
        "sliding_without_window",
        "full_with_window",
        "differing_field",
        "lost",
        "layer_refuses",
    ],
)
def test_export_refuses_what_config_json_cannot_express(kinds, expected):
    names = list(kinds)
    cfg = stack_cfg([names[0], names[1]], kinds)
    with pytest.raises(ValueError, match=expected):
        PatternedTransformer.hf_write(cfg)


def test_without_a_patterned_stack_per_layer_fields_are_still_refused():
    transformers = pytest.importorskip("transformers")
    from axplug_attention.llama import llama_base

    raw = transformers.Gemma3TextConfig(**GEMMA3_LEGACY).to_dict()
    fields = HFFields({k: v for k, v in raw.items() if k in OURS - {"rope_local_base_freq"}})
    cfg = llama_base(fields)
    read_fields(cfg.model, fields)
    problems = " | ".join(fields.problems)
    assert "layer_types mixes" in problems and "rope_parameters is keyed by layer type" in problems


@pytest.mark.parametrize(
    "updates, expected",
    [
        ({"layer_types": ["sliding_attention", "local"]}, "layer_types=['sliding_attention'"),
        ({"layer_types": ["full_attention"]}, "layer_types has 1 entries for num_hidden_layers=2"),
        ({"layer_types": None}, "missing layer_types"),
        ({"sliding_window": None}, "sliding_attention layers, but no sliding_window"),
    ],
)
def test_bad_pattern_fields_are_problems_named_by_field(updates, expected):
    raw = {
        **SHAPES,
        "num_hidden_layers": 2,
        "rope_theta": 10000.0,
        "layer_types": ["sliding_attention", "full_attention"],
        **updates,
    }
    fields = HFFields({k: v for k, v in raw.items() if v is not None})
    hf_model(fields)
    assert any(expected in p for p in fields.problems), fields.problems
