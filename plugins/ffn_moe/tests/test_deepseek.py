"""DeepSeek-V3 (DeepseekV3ForCausalLM): multi-head latent attention (axplug-attention's
`mla`), the DeepSeek router and the dense-first stack of axplug-moe.

References are written here, in float64 numpy, from transformers' modeling_deepseek_v3 (not
from the plugins' helpers): MLA with both RoPE layouts and both q paths, and the sigmoid
group-limited routing. Whole models are checked against transformers itself
(`check_against_transformers`: logits within 1e-5, 16 greedy tokens, the export reloaded).
The tiny models use initializer_range 0.1 so that routing depends on the token: at the
default 0.02 the (perturbed) correction bias alone decides, and a router that ignored the
groups would pass.
"""

from __future__ import annotations

import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from axplug.api import registry

axplug_moe = pytest.importorskip("axplug_moe")
pytest.importorskip("axplug_attention")
if not any(c.distribution == "axplug-moe" and c.loadable for c in registry.discover()):
    pytest.skip("axplug-moe is disabled", allow_module_level=True)

from axplug_attention.mla import MultiHeadLatentAttention  # noqa: E402
from axplug_moe import DeepSeekRouter, DenseFirstStack, MoEFeedForward  # noqa: E402

from axplug.api import EMPTY_POSITION, ParameterSpec  # noqa: E402
from axplug.api.config import ConfigError  # noqa: E402
from axplug.api.interop import HFImportError, hf_trainer_config, parse_hf_config  # noqa: E402
from axplug.api.layers import FeedForward, PagedKVCache, functional

F32 = dict(rtol=1e-5, atol=1e-5)


def normal(i: int, shape, scale: float = 1.0) -> np.ndarray:
    return (scale * np.random.default_rng(i).standard_normal(shape)).astype(np.float32)


def random_params(layer, seed: int, scale: float = 0.3):
    """Every parameter random (biases and norm scales too, so a dropped one shows); placed
    with `device_put` (`jnp.asarray` of a numpy array compiles a program per shape)."""
    specs = layer.create_parameter_specs_recursively()
    leaves, tree = jax.tree_util.tree_flatten_with_path(
        specs, is_leaf=lambda s: isinstance(s, ParameterSpec)
    )
    values = []
    for i, (path, spec) in enumerate(leaves):
        base = 1.0 if path[-1].key == "scale" else 0.0  # norms near 1
        values.append(jax.device_put(base + normal(seed + i, spec.shape, scale)))
    return jax.tree.unflatten(tree, values)


# ----------------------------------------------------------------- MLA, float64 reference

MLA = dict(
    input_dim=32,
    num_heads=4,
    kv_lora_rank=16,
    qk_nope_head_dim=8,
    qk_rope_head_dim=8,
    v_head_dim=12,
)


def mla_layer(**updates):
    cfg = MultiHeadLatentAttention.default_config().set(name="attention", **{**MLA, **updates})
    return cfg.instantiate(parent=None)


def _rms(x, scale, eps=1e-6):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * scale


def _rope(x, positions, theta, interleave):
    """transformers' DeepSeek RoPE on x [b, s, h, d]: `apply_rotary_pos_emb_interleave`
    (even/odd pairs, halves out) or `apply_rotary_pos_emb` (rotate_half)."""
    d = x.shape[-1]
    freqs = 1.0 / theta ** (np.arange(0, d, 2, dtype=np.float64) / d)
    angles = positions[..., None, None].astype(np.float64) * freqs  # [b, s, 1, d/2]
    cos, sin = np.cos(angles), np.sin(angles)
    x1, x2 = (x[..., 0::2], x[..., 1::2]) if interleave else (x[..., : d // 2], x[..., d // 2 :])
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def ref_mla(p, x, positions, *, q_lora_rank, interleave, bias, theta=10000.0):
    """DeepseekV3Attention in float64: x [b, s, dim] -> [b, s, dim], causal."""
    f = lambda a: np.asarray(a, np.float64)  # noqa: E731

    def linear(name, v):
        y = v @ f(p[name]["weight"])
        return y + f(p[name]["bias"]) if "bias" in p[name] else y

    x = f(x)
    b, s, _ = x.shape
    h, dn, dr = MLA["num_heads"], MLA["qk_nope_head_dim"], MLA["qk_rope_head_dim"]
    r = MLA["kv_lora_rank"]
    if q_lora_rank is None:
        q = linear("q_proj", x)
    else:
        q = linear("q_b_proj", _rms(linear("q_a_proj", x), f(p["q_a_norm"]["scale"])))
    q = q.reshape(b, s, h, dn + dr)
    kv = linear("kv_a_proj", x)
    latent = _rms(kv[..., :r], f(p["kv_a_norm"]["scale"]))
    k_rope = _rope(kv[..., None, r:], positions, theta, interleave)
    q_rope = _rope(q[..., dn:], positions, theta, interleave)
    kvb = linear("kv_b_proj", latent).reshape(b, s, h, -1)
    k = np.concatenate([kvb[..., :dn], np.broadcast_to(k_rope, (b, s, h, dr))], axis=-1)
    v = kvb[..., dn:]
    q = np.concatenate([q[..., :dn], q_rope], axis=-1)
    scores = np.einsum("bqhd,bkhd->bhqk", q, k) * (dn + dr) ** -0.5
    scores = np.where(np.tril(np.ones((s, s), bool)), scores, -np.inf)
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    out = np.einsum("bhqk,bkhd->bqhd", probs, v).reshape(b, s, -1)
    return linear("output", out)


MLA_CASES = {
    "q-lora-interleaved": dict(q_lora_rank=12, rope_interleave=True, bias=False),
    "q-proj-halves-bias": dict(q_lora_rank=None, rope_interleave=False, bias=True),
}


@pytest.mark.parametrize("case", list(MLA_CASES))
def test_mla_matches_the_float64_reference(case):
    opts = MLA_CASES[case]
    layer = mla_layer(**opts)
    params = random_params(layer, 100)
    names = set(params)
    want_q = {"q_proj"} if opts["q_lora_rank"] is None else {"q_a_proj", "q_a_norm", "q_b_proj"}
    assert names == want_q | {"kv_a_proj", "kv_a_norm", "kv_b_proj", "output"}
    assert ("bias" in params["kv_a_proj"]) == opts["bias"] == ("bias" in params["output"])
    assert "bias" not in params["kv_b_proj"]
    x = normal(1, (2, 9, 32))
    positions = np.broadcast_to(np.arange(9) + 3, (2, 9)).astype(np.int32)  # an offset too
    got = jax.jit(  # one program, not one per op
        lambda p, inputs: functional(
            layer, prng_key=None, state=p, is_training=False, inputs=inputs
        )[0]
    )(params, {"x": x, "positions": positions})
    want = ref_mla(
        params,
        x,
        positions,
        q_lora_rank=opts["q_lora_rank"],
        interleave=opts["rope_interleave"],
        bias=opts["bias"],
    )
    np.testing.assert_allclose(np.asarray(got, np.float64), want, **F32)


def test_mla_packed_segments_do_not_attend_across():
    layer = mla_layer(q_lora_rank=12)
    params = random_params(layer, 200)
    x = normal(2, (1, 8, 32))  # numpy throughout: no eager op to compile
    call = jax.jit(  # one program per shape, not one per op
        lambda x, pos, seg: functional(
            layer,
            prng_key=None,
            state=params,
            is_training=False,
            inputs={"x": x, "positions": pos, "segment_ids": seg},
        )[0]
    )
    positions = np.asarray([[0, 1, 2, 0, 1, 2, 3, 4]], np.int32)
    packed = call(x, positions, np.asarray([[1, 1, 1, 2, 2, 2, 2, 2]], np.int32))
    alone = call(x[:, 3:], positions[:, 3:], None)
    np.testing.assert_allclose(np.asarray(packed)[:, 3:], alone, **F32)


@pytest.mark.parametrize("cache", ["contiguous", "paged"])
def test_mla_decode_through_the_latent_cache_equals_forward(cache):
    kv_cache = PagedKVCache.default_config().set(page_size=4) if cache == "paged" else None
    layer = mla_layer(q_lora_rank=12, **({"kv_cache": kv_cache} if kv_cache else {}))
    params = random_params(layer, 300)
    b, s, max_len = 2, 10, 16
    # Numpy between the jitted calls: an eager op compiles a program per shape.
    x = normal(3, (b, s, 32))
    positions = np.broadcast_to(np.arange(s, dtype=np.int32), (b, s))
    want, _ = jax.jit(  # one program, not one per op
        lambda x, positions: functional(
            layer,
            prng_key=None,
            state=params,
            is_training=False,
            inputs={"x": x, "positions": positions},
        )
    )(x, positions)
    state = jax.jit(layer.init_cache_state, static_argnums=(0, 1))(b, max_len)
    # The compressed cache: one head of the latent (key) and of the rope key (value).
    assert state["key"].shape[0] == state["value"].shape[0] == 1
    assert state["key"].shape[-1] == MLA["kv_lora_rank"]
    assert state["value"].shape[-1] == MLA["qk_rope_head_dim"]

    @jax.jit
    def step(state, x, positions):
        return functional(
            layer,
            prng_key=None,
            state=params,
            is_training=False,
            method="extend_step",
            inputs={"x": x, "positions": positions, "cache_state": state},
        )[0]

    # Prefill of different lengths per row (right padding), then one token at a time.
    prompt = 4
    pad = np.asarray([[0, 0, 0, 0], [0, 0, 0, 1]], bool)
    first = np.where(pad, EMPTY_POSITION, positions[:, :prompt]).astype(np.int32)
    out, state = step(state, x[:, :prompt], first)
    out = np.asarray(out)
    outs = [out[0:1, :prompt], out[1:2, : prompt - 1]]
    rows = [[], []]
    t = [prompt, prompt - 1]
    while min(t) < s:
        idx = np.asarray([min(t[0], s - 1), min(t[1], s - 1)])
        live = np.asarray([t[0] < s, t[1] < s])
        pos = np.where(live, idx, EMPTY_POSITION)[:, None].astype(np.int32)
        out, state = step(state, x[np.arange(b), idx][:, None], pos)
        out = np.asarray(out)
        for i in range(b):
            if t[i] < s:
                rows[i].append(out[i : i + 1])
                t[i] += 1
    got = [np.concatenate([outs[i], *rows[i]], axis=1) for i in range(b)]
    np.testing.assert_allclose(np.concatenate(got, axis=0), want, **F32)
    assert list(np.asarray(state["length"])) == [s, s]


def test_mla_config_errors_name_the_field():
    with pytest.raises(ConfigError, match="qk_rope_head_dim: 7 must be even"):
        mla_layer(qk_rope_head_dim=7)
    with pytest.raises(ConfigError, match="q_lora_rank: 0"):
        mla_layer(q_lora_rank=0)


# ------------------------------------------------------------- routing, float64 reference


def ref_route(logits, bias, *, top_k, groups, top_groups, renormalize, factor):
    """DeepseekV3TopkRouter in float64: dense gates [g, s, e] (0 for unchosen experts)."""
    scores = 1.0 / (1.0 + np.exp(-np.asarray(logits, np.float64)))
    choice = scores + np.asarray(bias, np.float64)
    *lead, e = scores.shape
    per = e // groups
    out = np.zeros(scores.shape)
    for idx in np.ndindex(*lead):
        c = choice[idx].copy()
        group_score = np.sort(c.reshape(groups, per), axis=-1)[:, -2:].sum(-1)
        kept = np.argsort(-group_score, kind="stable")[:top_groups]
        mask = np.repeat(np.isin(np.arange(groups), kept), per)
        c[~mask] = -np.inf
        chosen = np.argsort(-c, kind="stable")[:top_k]
        w = scores[idx][chosen]
        if renormalize:
            w = w / (w.sum() + 1e-20)
        out[idx][chosen] = w * factor
    return out


ROUTER_CASES = {
    "groups-renormalized": dict(
        top_k=2, num_groups=4, top_groups=2, renormalize=True, scaling_factor=2.5
    ),
    "one-group-raw": dict(
        top_k=3, num_groups=1, top_groups=1, renormalize=False, scaling_factor=1.0
    ),
}


@pytest.mark.parametrize("case", list(ROUTER_CASES))
def test_deepseek_router_matches_the_float64_reference(case):
    opts = ROUTER_CASES[case]
    e, d = 8, 16
    cfg = DeepSeekRouter.default_config().set(
        name="router", input_dim=d, num_experts=e, capacity_factor=None, **opts
    )
    router = cfg.instantiate(parent=None)
    x = normal(1, (3, 10, d))
    w = normal(2, (d, e), 0.5)
    bias = normal(3, (e,), 0.5)
    params = {"weight": w, "e_score_correction_bias": bias}  # numpy into the jitted call
    routing = jax.jit(  # one program, not one per op
        lambda p, x: functional(router, prng_key=None, state=p, inputs=(x,), is_training=False)[0]
    )(params, x)
    got = np.zeros((3, 10, e))
    np.put_along_axis(
        got, np.asarray(routing.expert_index), np.asarray(routing.combine_weights), axis=-1
    )
    ref = dict(
        top_k=opts["top_k"],
        groups=opts["num_groups"],
        top_groups=opts["top_groups"],
        renormalize=opts["renormalize"],
        factor=opts["scaling_factor"],
    )
    logits = x.astype(np.float64) @ w
    want = ref_route(logits, bias, **ref)
    np.testing.assert_allclose(got, want, **F32)
    # The case really exercises the bias (choice only) and, with groups, the group limit.
    assert not np.allclose(want, ref_route(logits, 0 * bias, **ref))
    if opts["num_groups"] > 1:
        assert not np.allclose(want, ref_route(logits, bias, **{**ref, "top_groups": 4}))


def test_correction_bias_is_state_and_moves_only_with_the_update_rate():
    cfg = DeepSeekRouter.default_config().set(
        name="router", input_dim=16, num_experts=8, num_groups=2, top_groups=1
    )
    spec = cfg.instantiate(parent=None).create_parameter_specs_recursively()
    bias_spec = spec["e_score_correction_bias"]
    assert bias_spec.update == "state" and bias_spec.weight_decay_scale == 0.0
    assert bias_spec.dtype == jnp.float32
    x = jax.device_put(normal(4, (2, 12, 16)))  # `jnp.asarray` would compile a program
    params = {"weight": normal(5, (16, 8)), "e_score_correction_bias": np.zeros(8, np.float32)}

    @functools.partial(jax.jit, static_argnums=(1, 2))  # one program, not one per op
    def route(p, rate, training):
        router = cfg.clone(bias_update_rate=rate).instantiate(parent=None)
        routing, collection = functional(
            router, prng_key=None, state=p, inputs=(x,), is_training=training
        )
        return routing, collection.state_updates

    for rate, training in ((0.0, True), (0.01, False)):
        assert not route(params, rate, training)[1]
    routing, updates = route(params, 0.01, True)
    load = np.bincount(np.asarray(routing.expert_index).reshape(-1), minlength=8) / (2 * 12 * 2)
    want = 0.01 * np.sign(load.mean() - load)
    np.testing.assert_allclose(updates["e_score_correction_bias"], want)
    # No gradient reaches the bias: it only ranks experts.
    grad = jax.jit(jax.grad(lambda p: jnp.sum(route(p, 0.01, False)[0].combine_weights)))(params)
    assert not np.any(np.asarray(grad["e_score_correction_bias"]))
    assert np.any(np.asarray(grad["weight"]))


def test_router_config_errors_name_the_field():
    base = DeepSeekRouter.default_config().set(name="router", input_dim=16, num_experts=8)
    for updates, message in (
        (dict(num_groups=3), "num_groups=3 does not divide the 8 experts"),
        (dict(num_groups=8), "num_groups=8 leaves 1 expert per group"),
        (dict(num_groups=2, top_groups=3), "top_groups=3 is not between 1 and num_groups=2"),
        (dict(num_groups=4, top_groups=1, top_k=3), "top_k=3 exceeds the 2 experts"),
    ):
        with pytest.raises(ConfigError, match=message):
            base.clone(**updates).instantiate(parent=None)


# -------------------------------------------------------- the architecture, config.json only

RAW = dict(
    architectures=["DeepseekV3ForCausalLM"],
    model_type="deepseek_v3",
    vocab_size=96,
    hidden_size=32,
    intermediate_size=64,
    moe_intermediate_size=16,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=4,
    n_shared_experts=2,
    n_routed_experts=8,
    routed_scaling_factor=2.5,
    kv_lora_rank=16,
    q_lora_rank=None,
    qk_rope_head_dim=8,
    v_head_dim=12,
    qk_nope_head_dim=8,
    n_group=2,
    topk_group=1,
    num_experts_per_tok=2,
    first_k_dense_replace=1,
    norm_topk_prob=True,
    rms_norm_eps=1e-6,
    head_dim=8,
    qk_head_dim=16,
    rope_interleave=True,
    num_nextn_predict_layers=1,
    pretraining_tp=1,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    hidden_act="silu",
    attention_bias=False,
    attention_dropout=0.0,
    tie_word_embeddings=False,
)


def trainer_config(tmp_path, **updates):
    return hf_trainer_config(parse_hf_config({**RAW, **updates}), output_dir=str(tmp_path))


def test_architecture_builds_dense_first_then_moe_layers(tmp_path):
    cfg = trainer_config(tmp_path)
    stack = cfg.model.decoder.transformer
    assert stack.klass is DenseFirstStack and stack.num_layers == 3
    assert stack.num_dense_layers == 1
    assert stack.dense_layer.feed_forward.klass is FeedForward
    assert stack.dense_layer.feed_forward.hidden_dim == 64
    moe = stack.layer.feed_forward
    assert moe.klass is MoEFeedForward and moe.router.klass is DeepSeekRouter
    assert (moe.num_experts, moe.hidden_dim, moe.num_shared_experts) == (8, 16, 2)
    assert (moe.router.num_groups, moe.router.top_groups, moe.router.top_k) == (2, 1, 2)
    assert moe.router.scaling_factor == 2.5 and moe.router.capacity_factor is None
    for layer in (stack.layer, stack.dense_layer):
        attention = layer.attention
        assert attention.klass is MultiHeadLatentAttention
        assert attention.q_lora_rank is None and attention.rope_interleave is True
    model = cfg.model.instantiate(parent=None)
    layers = model.decoder.transformer
    assert [type(getattr(layers, f"layer{i}").feed_forward) for i in range(3)] == [
        FeedForward,
        MoEFeedForward,
        MoEFeedForward,
    ]


@pytest.mark.parametrize(
    "updates, message",
    [
        (
            dict(rope_parameters={"rope_type": "dynamic", "rope_theta": 1e4, "factor": 4.0}),
            "rope_type='dynamic'",
        ),
        (
            dict(rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 40.0}),
            "'yarn' lacks original_max_position_embeddings",
        ),
        (dict(num_key_value_heads=2), "num_key_value_heads=2 differs"),
        (dict(n_group=3), "n_group=3 does not divide the 8 experts"),
        (dict(head_dim=16), "head_dim=16 \\(MLA implies 8\\)"),
        (dict(n_shared_experts=0), "n_shared_experts=0"),
        (dict(scoring_func="softmax"), "scoring_func='softmax'"),
    ],
)
def test_architecture_refuses_what_it_does_not_compute_by_name(tmp_path, updates, message):
    with pytest.raises(HFImportError, match=message):
        trainer_config(tmp_path, **updates)


def test_training_moves_the_bias_only_by_its_update_rule(tmp_path):
    from axplug_testing import train_steps

    from axplug.api.config import apply_overrides

    steps, rate = 3, 0.01
    # The byte-level text the trainer reads; one MoE layer: the rule is the router's (a dense
    # layer before it, or a second MoE layer, only traced and compiled more).
    cfg = trainer_config(tmp_path, vocab_size=256, num_hidden_layers=1, first_k_dense_replace=0)
    cfg = apply_overrides(
        cfg.clone(summary_writers=[]),
        [
            "compilation_cache_dir=None", "input.seq_len=16", "input.batch_size=4",
            f"max_steps={steps}",
            f"model.decoder.transformer.layer.feed_forward.router.bias_update_rate={rate}",
        ],
    )  # fmt: skip
    # The built step, as a run calls it: it applies the state updates (no checkpoint needed).
    state, _ = train_steps(cfg.instantiate(devices=jax.devices()[:1]), steps)
    params = jax.device_get(state["params"])["decoder"]["transformer"]
    # Exactly `steps` float32 additions of +-rate (an optimizer step, however small, would
    # leave another value).
    reachable = {np.float32(0.0)}
    for _ in range(steps):
        reachable = {np.float32(v + d) for v in reachable for d in (-rate, 0.0, rate)}
    bias = params["layer0"]["feed_forward"]["router"]["e_score_correction_bias"]
    assert bias.dtype == np.float32 and np.any(bias != 0)
    assert all(np.float32(b) in reachable for b in bias), bias


def test_dense_first_stack_checks_its_layer_count():
    cfg = DenseFirstStack.default_config().set(input_dim=8, num_layers=2, num_dense_layers=3)
    with pytest.raises(ConfigError, match="num_dense_layers: 3 must be between 0 and"):
        cfg.instantiate(parent=None)


# ------------------------------------------------------------------ against transformers

transformers = pytest.importorskip("transformers")
from axplug_models.testing import check_against_transformers  # noqa: E402

TOL = 1e-5
SHAPES = dict(
    vocab_size=96,
    hidden_size=32,
    intermediate_size=64,
    moe_intermediate_size=16,
    num_attention_heads=4,
    num_key_value_heads=4,
    kv_lora_rank=16,
    qk_rope_head_dim=8,
    qk_nope_head_dim=8,
    v_head_dim=12,
    n_group=2,
    topk_group=1,
    num_experts_per_tok=2,
    first_k_dense_replace=1,
    max_position_embeddings=128,
    initializer_range=0.1,
)

FAMILIES = {
    # q compressed (q_lora_rank), interleaved RoPE, 8 experts in 2 groups; the dense layer
    # and one MoE layer (a second MoE layer, unrolled, compiled the same layer again; the
    # scanned variant below has two, as the scan needs).
    "q-lora": dict(num_hidden_layers=2, q_lora_rank=24, n_routed_experts=8, n_shared_experts=1),
    # q straight from the input, rotate-half RoPE, biases, raw gates, 2 shared experts.
    # ... and YaRN RoPE scaling (frequencies, cos/sin factor, softmax temperature).
    "q-proj-yarn": dict(
        num_hidden_layers=2,
        q_lora_rank=None,
        rope_interleave=False,
        attention_bias=True,
        n_routed_experts=4,
        n_shared_experts=2,
        norm_topk_prob=False,
        routed_scaling_factor=1.5,
        tie_word_embeddings=True,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 4.0,
            "original_max_position_embeddings": 32,
            "mscale": 0.707,
            "mscale_all_dim": 1.0,
        },
    ),
}


# q-lora with three layers: the dense one, then two MoE layers for `scan_layers` to scan.
SCANNED = {**FAMILIES["q-lora"], "num_hidden_layers": 3}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_deepseek_v3_matches_transformers(family, tmp_path):
    config = transformers.DeepseekV3Config(**{**SHAPES, **FAMILIES[family]})
    check = check_against_transformers(config, tmp_path)
    assert not check.mismatches(TOL), check
    assert check.architecture == "DeepseekV3ForCausalLM"
    exported = json.loads((tmp_path / "out" / "config.json").read_text())
    assert exported["q_lora_rank"] == FAMILIES[family]["q_lora_rank"]
    assert exported["first_k_dense_replace"] == 1
    if family == "q-proj-yarn":  # once: it compiles another engine
        assert_paged_batching_matches(check)


def assert_paged_batching_matches(check):
    """Continuous batching through paged latent caches (2 slots for 3 prompts of different
    lengths: rows reused) gives transformers' greedy tokens for every prompt."""
    from axplug_models.testing import PROMPT, _hf_greedy

    from axplug.api.run import SamplingParams, generate, load_checkpoint

    reference = check.reference  # the model the check saved: not read again
    prompts = [list(PROMPT), list(PROMPT[:5]), list(PROMPT[4:])]
    loaded = load_checkpoint(check.run_dir, modifiers=["paged_kv_cache:page_size=4"])
    completions = generate(
        loaded.model,
        loaded.params,
        prompts,
        SamplingParams(max_new_tokens=8, temperature=0.0),
        num_slots=2,
    )
    # PROMPT's greedy tokens are the first 8 of the 16 the check had transformers generate.
    want = [check.greedy_transformers[:8]]
    want += [_hf_greedy(reference, tuple(prompt), 8) for prompt in prompts[1:]]
    for prompt, completion, tokens in zip(prompts, completions, want, strict=True):
        assert list(completion.output_ids) == tokens, prompt


# --------------------------------------------------------------- the conformance kit

from axplug_testing import LayerConformance  # noqa: E402


class TestDeepSeekMoEConformance(LayerConformance):
    """The kit on DeepSeek-V3's MoE layer: group-limited sigmoid routing with its correction
    bias (state, not trained by gradient), routed scaling and a shared expert, swapped for
    gpt-tiny's dense feed-forward."""

    @pytest.fixture
    def layer_config(self):
        cfg = MoEFeedForward.default_config().set(
            input_dim=16, hidden_dim=24, num_experts=8, num_shared_experts=1
        )
        cfg.router = DeepSeekRouter.default_config().set(
            top_k=2, num_groups=4, top_groups=2, scaling_factor=2.5, capacity_factor=None
        )
        return cfg

    @pytest.fixture
    def inputs(self, input_shape):
        return (jax.device_put(normal(1, input_shape)),)  # numpy: no random program to compile

    @pytest.fixture
    def mesh_shape(self):
        return (2, 1, 2, 1, 2)  # data, expert and model parallel at once


def test_scanned_deepseek_v3_matches_transformers(tmp_path):
    """`scan_layers`: the dense layer unrolled, the two MoE layers after it scanned (full
    remat); import, greedy decoding through the stacked caches and export as unrolled."""
    config = transformers.DeepseekV3Config(**SHAPES, **SCANNED)
    check = check_against_transformers(
        config, tmp_path, modifiers=["scan_layers:remat_policy=full"]
    )
    assert not check.mismatches(TOL), check
    exported = json.loads((tmp_path / "out" / "config.json").read_text())
    assert (exported["num_hidden_layers"], exported["first_k_dense_replace"]) == (3, 1)


def test_scan_layers_makes_a_dense_first_stack_scanned_and_equal():
    from axplug_moe import RepeatedDenseFirstStack

    from axplug.api.config import make_modifier
    from axplug.api.layers import RepeatedTransformer

    raw = {"architectures": ["DeepseekV3ForCausalLM"],
           **transformers.DeepseekV3Config(**SHAPES, **SCANNED).to_dict()}  # fmt: skip
    unrolled = hf_trainer_config(parse_hf_config(raw), output_dir="unused")
    scanned = hf_trainer_config(
        parse_hf_config(raw), output_dir="unused", modifiers=["scan_layers:remat_policy=full"]
    )
    stack = scanned.model.decoder.transformer
    assert stack.klass is RepeatedDenseFirstStack and stack.remat_policy == "full"
    assert (stack.num_layers, stack.num_dense_layers) == (3, 1)
    again = make_modifier("scan_layers:remat_policy=dots")(scanned).model.decoder.transformer
    assert again.klass is RepeatedDenseFirstStack and again.remat_policy == "dots"

    a = unrolled.model.clone(name="model").instantiate(parent=None)
    b = scanned.model.clone(name="model").instantiate(parent=None)
    assert isinstance(b.decoder.transformer.layer, RepeatedTransformer)
    params = random_params(a, 400, scale=0.1)  # numpy: no initializer to run
    stacked = dict(params["decoder"]["transformer"])
    moe = [stacked.pop(f"layer{i}") for i in range(1, 3)]
    transformer = {"dense0": stacked.pop("layer0")}
    transformer["layer"] = {"layer": jax.tree.map(lambda *x: np.stack(x), *moe)}
    scanned_params = {**params, "decoder": {**params["decoder"], "transformer": transformer}}
    ids = jax.device_put(np.asarray([[1, 5, 9, 3, 7, 2]], np.int32))

    def logits(model, p):
        out, _ = functional(
            model,
            prng_key=None,
            state=p,
            inputs={"input_ids": ids},
            is_training=False,
            method="predict",
        )
        return out

    np.testing.assert_allclose(
        np.asarray(jax.jit(lambda p: logits(b, p))(scanned_params)),
        np.asarray(jax.jit(lambda p: logits(a, p))(params)),
        rtol=1e-5,
        atol=1e-5,
    )


def test_a_dense_first_stack_with_more_dense_layers_than_layers_is_an_error():
    from axplug_moe import RepeatedDenseFirstStack

    cfg = RepeatedDenseFirstStack.default_config().set(
        name="stack", input_dim=8, num_layers=2, num_dense_layers=3
    )
    with pytest.raises(ConfigError, match=r"num_dense_layers: 3 must be between 0 and num_"):
        cfg.instantiate(parent=None)
