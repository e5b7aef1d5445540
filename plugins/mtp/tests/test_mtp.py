"""Multi-token prediction: the loss against a plain-jnp statement of DeepSeek-V3's formula
(packed documents, two depths, perturbed norms), training a DeepSeek-style model, and the
modifier's errors."""

import jax
import numpy as np
import pytest
from axplug_mtp import MultiTokenPredictionLM

from axplug.api.config import ConfigError, find_configs, preset_config
from axplug.api.layers import functional

TINY = [
    "model.decoder.dim=32",
    "model.decoder.transformer.num_layers=2",
    "model.decoder.transformer.layer.feed_forward.hidden_dim=64",
    "model.decoder.vocab_size=97",
]


def tiny_model(*modifiers):
    cfg = preset_config("llama-tiny", modifiers=["mtp:depth=2,loss_weight=0.5", *modifiers],
                        overrides=TINY)  # fmt: skip
    return cfg.model.instantiate(parent=None)


def rms(x, scale, eps):
    x = np.asarray(x, np.float64)
    return x / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps) * np.asarray(scale, np.float64)


def ce(logits, labels):
    """Mean cross entropy over labels >= 0, in numpy."""
    logits = np.asarray(logits, np.float64)
    z = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1)
    picked = np.take_along_axis(logits, np.maximum(labels, 0)[..., None], -1)[..., 0]
    keep = labels >= 0
    return float(((z - picked) * keep).sum() / keep.sum())


def test_loss_equals_deepseek_v3_formula_by_hand():
    model = tiny_model()
    params = jax.jit(model.initialize_parameters_recursively)(jax.random.PRNGKey(0))
    # Every norm scale perturbed: a swapped or missing norm must show.
    noise = np.random.default_rng(1)
    params = jax.tree_util.tree_map_with_path(
        lambda path, p: np.asarray(p) + 0.3 * noise.normal(size=p.shape).astype(np.float32)
        if "norm" in jax.tree_util.keystr(path) else np.asarray(p), params)  # fmt: skip
    rng = np.random.default_rng(0)
    b, s = 2, 24
    ids = rng.integers(0, 97, size=(b, s)).astype(np.int32)
    seg = np.sort(rng.integers(1, 4, size=(b, s)), axis=1).astype(np.int32)
    pos = np.zeros((b, s), np.int32)
    for t in range(1, s):
        pos[:, t] = np.where(seg[:, t] == seg[:, t - 1], pos[:, t - 1] + 1, 0)
    nxt = np.concatenate([ids[:, 1:], rng.integers(0, 97, size=(b, 1))], axis=1)
    ends = np.concatenate([seg[:, 1:] != seg[:, :-1], np.zeros((b, 1), bool)], axis=1)
    labels = np.where(ends, -1, nxt).astype(np.int32)  # as packed rows are labelled

    def call(module, state, method="forward", **inputs):  # compiled: one program a call
        run = lambda state, inputs: functional(
            module,
            prng_key=None,
            state=state,  # noqa: E731
            inputs=inputs,
            is_training=False,
            method=method,
        )[0]
        return jax.jit(run)(state, inputs)  # fmt: skip

    inputs = dict(input_ids=ids, target_labels=labels, positions=pos, segment_ids=seg)
    got, _ = call(model, params, **inputs)

    # By hand: h_0 is the main model's normed output; module k takes E(t_{i+k}) and h_{k-1}.
    dec, p_dec = model.decoder, params["decoder"]
    eps = model.config.module.norm.eps
    emb, head = (np.asarray(p_dec[n]["weight"], np.float64) for n in ("embedding", "lm_head"))
    h = call(dec, p_dec, "hidden_states", input_ids=ids, positions=pos, segment_ids=seg)
    h = rms(h, p_dec["output_norm"]["scale"], model.config.decoder.output_norm.eps)
    main = h @ head
    want = ce(main, labels)
    for k in (1, 2):
        p = params[f"mtp{k - 1}"]
        ahead = np.full_like(ids, 0)
        ahead[:, :-k] = ids[:, k:]
        x = np.concatenate([rms(emb[ahead], p["enorm"]["scale"], eps),
                            rms(h, p["hnorm"]["scale"], eps)], -1)  # fmt: skip
        x = (x @ p["eh_proj"]["weight"]).astype(np.float32)
        block = getattr(model, f"mtp{k - 1}").block
        h = rms(call(block, p["block"], x=x, positions=pos, segment_ids=seg),
                p["post_norm"]["scale"], eps)  # fmt: skip
        target = np.full_like(labels, -1)
        target[:, :-k] = labels[:, k:]
        same = np.zeros_like(seg, bool)
        same[:, :-k] = seg[:, k:] == seg[:, :-k]
        target = np.where(same, target, -1)
        want += 0.5 / 2 * ce(h @ head, target)
    np.testing.assert_allclose(float(got), want, rtol=2e-5)


DEEPSEEK = dict(  # a tiny DeepSeek-V3 config.json: MLA, a dense layer, then an MoE layer
    architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3", vocab_size=256,
    hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=4,
    routed_scaling_factor=2.5, kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=8,
    v_head_dim=8, qk_nope_head_dim=8, n_group=2, topk_group=1, num_experts_per_tok=2,
    first_k_dense_replace=1, norm_topk_prob=True, rms_norm_eps=1e-6, rope_interleave=True,
    num_nextn_predict_layers=1, pretraining_tp=1, hidden_act="silu", attention_bias=False,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, tie_word_embeddings=False,
)  # fmt: skip


def test_a_deepseek_style_model_trains_with_it(tmp_path):
    pytest.importorskip("axplug_moe")
    from axplug_testing import train_steps

    from axplug.api.config import apply_overrides, make_modifier
    from axplug.api.interop import hf_trainer_config, parse_hf_config

    cfg = hf_trainer_config(parse_hf_config(DEEPSEEK), output_dir=str(tmp_path))
    cfg = make_modifier("mtp:depth=1")(cfg.clone(summary_writers=[]))
    cfg = apply_overrides(cfg, ["compilation_cache_dir=None", "input.seq_len=32",
                                "input.batch_size=4", "max_steps=4", "learner.learning_rate=1e-2",
                                "learner.warmup_steps=0"])  # fmt: skip
    lm = find_configs(cfg, MultiTokenPredictionLM)[0][1]
    # The module's block is the stack's MoE layer (DeepSeek-V3's MTP layer is one too).
    assert lm.module.block.feed_forward.klass.__name__ == "MoEFeedForward"
    _, metrics = train_steps(cfg.instantiate(devices=jax.devices()[:1]), 4)
    assert all(np.isfinite(m["mtp/loss_1"]) for m in metrics)
    assert metrics[-1]["loss"] < metrics[0]["loss"]
    assert metrics[-1]["mtp/loss_1"] < metrics[0]["mtp/loss_1"]


def test_bad_options_are_one_clear_error():
    with pytest.raises(ConfigError, match="depth=0 must be >= 1"):
        tiny_model("mtp:depth=0")


def test_the_modules_propose_for_speculative_decoding():
    """`Engine(speculative=mtp)` with the model's own modules: the greedy tokens of plain
    decoding, and every first draft (the main model's own next token) taken."""
    from axplug_mtp import MTPProposer

    from axplug.api.run import Engine, Request, SamplingParams

    model = tiny_model()
    params = jax.jit(model.initialize_parameters_recursively)(jax.random.PRNGKey(0))
    prompts = [[4, 5, 6, 7, 4, 5], [9, 10, 11, 12, 13], [30, 2, 17]]

    def decode(proposer=None):
        engine = Engine(model, params, num_slots=3, max_len=40, speculative=proposer)
        greedy = SamplingParams(max_new_tokens=12, temperature=0)
        ids = [engine.submit(Request(p, greedy)) for p in prompts]
        done = {c.id: c.output_ids for c in engine.run()}
        return [done[i] for i in ids], engine

    want, _ = decode()
    cfg = MTPProposer.default_config().set(num_tokens=3)
    got, engine = decode(MTPProposer(cfg, model=model, params=params))
    assert got == want
    # Each verifying step proposes up to 3 (the main model's token and the two modules');
    # the first is the target's own greedy token, so at least a third are taken.
    assert engine.proposed_tokens > 0
    assert engine.accepted_tokens >= engine.proposed_tokens // 3
    with pytest.raises(ConfigError, match="name a run trained with --modifier mtp"):
        Engine(model, params, speculative="mtp")
