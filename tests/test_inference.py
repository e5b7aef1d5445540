"""axplug.inference: KV-cache decoding against the full forward pass, the paged cache against
the contiguous one, sampling, continuous batching against decoding each request alone,
checkpoint loading and `axplug generate`.

Tolerances: float32 logits of prefill + decode vs one forward pass reduce in different orders,
so rtol = atol = 1e-4 (as in plugins/attention/tests/test_attention_plugin.py). Token ids are
compared exactly.
"""

from __future__ import annotations

import functools
import json
import weakref

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from axplug import registry
from axplug.cli import main
from axplug.context import functional
from axplug.inference import (
    Engine,
    OutOfPagesError,
    PageAllocator,
    Request,
    SamplingParams,
    generate,
    load_checkpoint,
    sample_tokens,
)
from axplug.layers import CausalLM, Embedding, LayerNorm, QKVLinear, RMSNorm
from axplug.layers.kv_cache import EMPTY_POSITION, set_block_tables
from axplug.modifiers import make_modifier

LOOSE = dict(rtol=1e-4, atol=1e-4)
VOCAB, DIM, HEADS = 61, 32, 4


def _installed(dist: str) -> bool:
    return any(c.distribution == dist and c.loadable for c in registry.discover())


needs_attention = pytest.mark.skipif(
    not _installed("axplug-attention"), reason="axplug-attention is not installed"
)
needs_moe = pytest.mark.skipif(not _installed("axplug-moe"), reason="axplug-moe is not installed")


def lm_cfg(*modifiers: str, layers: int = 2):
    cfg = CausalLM.default_config()
    cfg.decoder.set(vocab_size=VOCAB, dim=DIM)
    cfg.decoder.transformer.set(num_layers=layers)
    cfg.decoder.transformer.layer.attention.set(num_heads=HEADS)
    cfg.decoder.transformer.layer.feed_forward.set(hidden_dim=64)
    for spec in modifiers:
        cfg = make_modifier(spec)(cfg)
    return cfg


def build(cfg, seed: int = 0):
    model = cfg.instantiate(parent=None)
    return model, model.initialize_parameters_recursively(jax.random.PRNGKey(seed))


def call(model, params, inputs, method):
    out, _ = functional(
        model, prng_key=None, state=params, inputs=inputs, is_training=False, method=method
    )
    return out


@functools.partial(jax.jit, static_argnums=0)
def forward_logits(model, params, ids):
    return call(model, params, (jnp.asarray(ids, jnp.int32),), "predict")


def random_ids(seed: int, shape) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, VOCAB, shape).astype(np.int32)


_EXTEND_STEPS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def extend_step(model):
    """`model`'s extend_step jitted: (params, ids, positions, cache) -> (logits, cache), one
    per model (a model shared by tests traces each shape once)."""
    if model not in _EXTEND_STEPS:
        _EXTEND_STEPS[model] = jax.jit(
            lambda p, i, pos, c: call(
                model, p, {"input_ids": i, "positions": pos, "cache_state": c}, "extend_step"
            )
        )
    return _EXTEND_STEPS[model]


def decode_logits(model, params, ids: np.ndarray, prompt_lens, max_len: int, cache=None):
    """Logits of every token of every row: a batched prefill of each row's first
    `prompt_lens[b]` tokens (right-padded), then one token per call for the rest."""
    batch, total = ids.shape
    step = extend_step(model)
    cache = model.init_cache_state(batch, max_len) if cache is None else cache
    width = max(prompt_lens)
    positions = np.full((batch, width), EMPTY_POSITION, np.int32)
    prefill_ids = np.zeros((batch, width), np.int32)
    for b, n in enumerate(prompt_lens):
        positions[b, :n] = np.arange(n)
        prefill_ids[b, :n] = ids[b, :n]
    logits, cache = step(params, prefill_ids, positions, cache)
    out = np.zeros((batch, total, VOCAB), np.float32)
    logits = np.asarray(logits)  # sliced on the host, not by an op compiled per slice
    for b, n in enumerate(prompt_lens):
        out[b, :n] = logits[b, :n]
    for t in range(min(prompt_lens), total):
        pos = np.where(np.asarray(prompt_lens) <= t, t, EMPTY_POSITION)[:, None].astype(np.int32)
        logits, cache = step(params, ids[:, t : t + 1], pos, cache)
        logits = np.asarray(logits)
        for b, n in enumerate(prompt_lens):
            if t >= n:
                out[b, t] = logits[b, 0]
    lengths = np.asarray(jax.tree.leaves(cache_lengths(cache))[0])
    assert (lengths == total).all(), lengths
    return out, cache


def cache_lengths(cache):
    return jax.tree_util.tree_map_with_path(
        lambda path, leaf: leaf if path[-1].key == "length" else None, cache
    )


DECODE_CASES = {
    "plain": (),
    "scanned": ("scan_layers",),
    "paged": ("paged_kv_cache:page_size=4",),
}
if _installed("axplug-attention"):
    DECODE_CASES |= {  # rope on its own: the rope_gqa case's rotary path, every head its own
        "rope_gqa": ("rope", "gqa:num_kv_heads=2"),
        "rope_gqa_paged_scanned": (
            "rope",
            "gqa:num_kv_heads=1",
            "paged_kv_cache:page_size=3",
            "scan_layers",
        ),
    }
if _installed("axplug-moe"):
    DECODE_CASES |= {  # MoE blocks between dense ones, scanned: no cache holds either block
        "moe_every2_scanned": (
            "moe:num_experts=4,top_k=2,every=2,capacity_factor=None",
            "scan_layers",
        ),
    }


@pytest.fixture(scope="module")
def plain_lm():
    """build(lm_cfg()): the model (and its traced programs) of the tests of the plain cache."""
    return build(lm_cfg())


def _decode_layers(mods) -> int:
    """2 layers (the caches of several), 4 for a MoE every 2nd layer, scanned (a scan over two
    pairs), 1 for a MoE in every layer: a feed-forward block, which no cache holds."""
    if "moe:" in str(mods):
        return 4 if "every=2" in str(mods) else 1
    return 2


@pytest.mark.parametrize("mods", list(DECODE_CASES.values()), ids=list(DECODE_CASES))
def test_decoding_with_the_cache_gives_the_forward_logits(mods, plain_lm):
    layers = _decode_layers(mods)
    model, params = build(lm_cfg(*mods, layers=layers)) if mods else plain_lm
    ids = random_ids(1, (3, 11))
    full = np.asarray(forward_logits(model, params, ids))
    decoded, _ = decode_logits(model, params, ids, prompt_lens=[5, 2, 7], max_len=12)
    np.testing.assert_allclose(decoded, full, **LOOSE)


def _layer(**fields):
    """An edit of an `lm_cfg` config: `fields` set on every transformer layer."""

    def edit(cfg):
        cfg.decoder.transformer.layer.set(**fields)
        return cfg

    return edit


def _decoder(**fields):
    """An edit of an `lm_cfg` config: `fields` set on the decoder."""

    def edit(cfg):
        cfg.decoder.set(**fields)
        return cfg

    return edit


def _attention(**fields):
    """An edit of an `lm_cfg` config: `fields` set on every attention layer."""

    def edit(cfg):
        cfg.decoder.transformer.layer.attention.set(**fields)
        return cfg

    return edit


def randomized(params, seed: int = 7):
    """`params` plus small random values: zero biases and unit norm scales matter then."""
    leaves, treedef = jax.tree.flatten(params)
    rng = np.random.default_rng(seed)
    # On the host (float32, as jax adds them), not by an add compiled per shape.
    noise = [(0.3 * rng.standard_normal(a.shape)).astype(a.dtype) for a in leaves]
    return treedef.unflatten([np.asarray(a) + n for a, n in zip(leaves, noise, strict=True)])


def _gpt2(cfg):
    """GPT-2's shape: learned positions, LayerNorms, a plain GELU MLP, biases everywhere."""
    cfg.decoder.set(
        position_embedding=Embedding.default_config(),
        max_positions=12,
        tie_word_embeddings=True,
        output_norm=LayerNorm.default_config(),
    )
    layer = cfg.decoder.transformer.layer
    layer.norm = LayerNorm.default_config()
    layer.feed_forward.set(activation="gelu_tanh", gated=False)
    layer.feed_forward.linear.bias = True
    layer.attention.qkv.bias = True
    layer.attention.output.bias = True
    return cfg


# Options of the core layers that Hugging Face families need: (config edits, modifiers).
OPTION_CASES = {
    # Options of different places (a layer's norms, the embedding, the attention scores) of
    # one unscanned contiguous layer: one model shows each.
    "post_norms_embedding_scale_attention_softcap": (
        (_layer(post_norm=True), _decoder(embedding_scale=DIM**0.5), _attention(logit_softcap=0.5)),
        (),
    ),
    "post_norms_only_scanned_paged": (
        (_layer(pre_norm=False, post_norm=True),),
        ("scan_layers", "paged_kv_cache:page_size=4"),
    ),
    "final_logit_softcap_scanned": ((_decoder(final_logit_softcap=2.0),), ("scan_layers",)),
    "position_embedding_paged": (
        (_decoder(position_embedding=Embedding.default_config(), max_positions=12),),
        ("paged_kv_cache:page_size=4",),
    ),
    # Decode steps read the cache through the paged kernel with the cap, prefill densely.
    "attention_softcap_paged_flash": (
        (_attention(logit_softcap=0.5),),
        ("paged_kv_cache:page_size=4", "flash_attention"),
    ),
    "qk_norm_qkv_bias_scanned": (
        (
            _attention(
                qk_norm=RMSNorm.default_config(), qkv=QKVLinear.default_config().set(bias=True)
            ),
        ),
        ("scan_layers",),
    ),
    "qk_norm_projection_paged": (
        (_attention(qk_norm=RMSNorm.default_config(), qk_norm_over="projection"),),
        ("paged_kv_cache:page_size=4",),
    ),
    "gpt2_like": ((_gpt2,), ()),
}
if _installed("axplug-attention"):

    def _gemma(cfg):
        gemma_norm = RMSNorm.default_config().set(scale_offset=1.0)
        cfg.decoder.set(
            embedding_scale=DIM**0.5,
            final_logit_softcap=2.0,
            tie_word_embeddings=True,
            output_norm=gemma_norm.clone(),
        )
        layer = cfg.decoder.transformer.layer
        layer.set(norm=gemma_norm.clone(), post_norm=True)
        layer.feed_forward.set(activation="gelu_tanh")
        layer.attention.set(logit_softcap=0.5, qk_norm=gemma_norm.clone())
        layer.attention.kernel.set(scale=0.3)  # query_pre_attn_scalar ** -0.5
        return cfg

    OPTION_CASES |= {
        "qwen_like_gqa_paged": (
            (
                _attention(
                    qk_norm=RMSNorm.default_config(), qkv=QKVLinear.default_config().set(bias=True)
                ),
            ),
            ("rope", "gqa:num_kv_heads=2", "paged_kv_cache:page_size=3"),
        ),
        "olmo2_like_gqa": (
            (
                _layer(pre_norm=False, post_norm=True),
                _attention(qk_norm=RMSNorm.default_config(), qk_norm_over="projection"),
            ),
            ("rope", "gqa:num_kv_heads=2"),
        ),
        "gemma_like_gqa_paged_scanned_flash": (
            (_gemma,),
            (
                "rope",
                "gqa:num_kv_heads=2",
                "paged_kv_cache:page_size=4",
                "scan_layers",
                "flash_attention",
            ),
        ),
        "gemma_like_contiguous": ((_gemma,), ("rope", "gqa:num_kv_heads=1")),
    }


@pytest.mark.parametrize("edits,mods", list(OPTION_CASES.values()), ids=list(OPTION_CASES))
def test_decoding_with_layer_options_gives_the_forward_logits(edits, mods):
    # An option acts within a layer (or the decoder): one layer shows it, unless scanned (a scan
    # over 2 layers slices their stacked parameters and caches). The cache of each of several
    # layers is the decoding cases' claim.
    cfg = lm_cfg(layers=2 if "scan_layers" in mods else 1)
    for edit in edits:
        cfg = edit(cfg)
    for spec in mods:
        cfg = make_modifier(spec)(cfg)
    model, params = build(cfg)
    params = randomized(params)
    ids = random_ids(1, (3, 11))
    full = np.asarray(forward_logits(model, params, ids))
    decoded, _ = decode_logits(model, params, ids, prompt_lens=[5, 2, 7], max_len=12)
    np.testing.assert_allclose(decoded, full, **LOOSE)


def test_paged_cache_with_scattered_pages_matches_the_contiguous_cache(plain_lm):
    # The `plain` decoding case's model, tokens and shapes: the reference compiles nothing new.
    contiguous, params = plain_lm
    paged = lm_cfg("paged_kv_cache:page_size=2,num_pages=20").instantiate(parent=None)
    ids = random_ids(1, (3, 11))
    want, _ = decode_logits(contiguous, params, ids, prompt_lens=[5, 2, 7], max_len=12)
    # Each row's pages anywhere in the pool, in no particular order (13 and 16 unused).
    table = np.array([[17, 3, 9, 0, 12, 6], [5, 19, 1, 14, 8, 11], [2, 15, 7, 18, 4, 10]], np.int32)
    cache = set_block_tables(paged.init_cache_state(3, 12), table)
    got, cache = decode_logits(paged, params, ids, prompt_lens=[5, 2, 7], max_len=12, cache=cache)
    np.testing.assert_allclose(got, want, **LOOSE)
    pool = cache["transformer"]["layer0"]["attention"]
    assert pool["key"].shape[1:3] == (20, 2) and pool["block_table"].shape == (3, 6)
    # Only the pages in the table were written.
    written = np.flatnonzero((np.asarray(pool["positions"]) != EMPTY_POSITION).any(axis=1))
    assert sorted(written) == sorted(table.ravel())


def test_a_pool_too_small_for_the_rows_is_an_error():
    paged = lm_cfg("paged_kv_cache:page_size=2,num_pages=5").instantiate(parent=None)
    with pytest.raises(ValueError, match=r"num_pages=5: 2 rows of up to 10 tokens need 10 pages"):
        paged.init_cache_state(2, 10)
    paged.init_cache_state(1, 10)  # one row fits


def test_a_row_without_pages_never_touches_another_rows_pages(plain_lm):
    """A scheduler's pool of 6 pages for 3 rows x 6: rows 1 and 2 have none yet. Row 0
    decodes exactly as in the contiguous cache, and no page is written for rows 1 and 2 (they
    pointed at page 0 and overwrote row 0). The `plain` decoding case's model, tokens and
    shapes: the reference compiles nothing new."""
    from axplug.layers.kv_cache import assigning_pages

    contiguous, params = plain_lm
    paged = lm_cfg("paged_kv_cache:page_size=2,num_pages=6").instantiate(parent=None)
    ids = random_ids(1, (3, 11))
    want, _ = decode_logits(contiguous, params, ids, prompt_lens=[5, 2, 7], max_len=12)
    with assigning_pages():
        cache = paged.init_cache_state(3, 12)
    table = cache["transformer"]["layer0"]["attention"]["block_table"]
    np.testing.assert_array_equal(table, [[0, 1, 2, 3, 4, 5], [6] * 6, [6] * 6])  # 6: no page
    got, cache = decode_logits(paged, params, ids, prompt_lens=[5, 2, 7], max_len=12, cache=cache)
    np.testing.assert_allclose(got[:1], want[:1], **LOOSE)
    pool = np.asarray(cache["transformer"]["layer0"]["attention"]["positions"])
    # Row 0's 11 tokens at positions 0..10 in its pages, and nothing of rows 1, 2 anywhere.
    np.testing.assert_array_equal(pool.reshape(-1), [*range(11), EMPTY_POSITION])


def test_cache_drops_padding_and_reports_only_cached_slots(plain_lm):
    # The prefill shapes of the `plain` decoding case (3 rows, 7 wide, 12 slots): its program.
    model, params = plain_lm
    cache = model.init_cache_state(3, 12)
    ids = np.arange(1, 22, dtype=np.int32).reshape(3, 7)
    positions = np.full((3, 7), EMPTY_POSITION, np.int32)
    positions[0, :3], positions[1, 0] = [0, 1, 2], 0  # row 2: padding only
    _, cache = extend_step(model)(params, ids, positions, cache)
    layer = cache["transformer"]["layer0"]["attention"]
    np.testing.assert_array_equal(layer["length"], [3, 1, 0])
    np.testing.assert_array_equal(
        layer["positions"],
        [[0, 1, 2] + [EMPTY_POSITION] * 9, [0] + [EMPTY_POSITION] * 11, [EMPTY_POSITION] * 12],
    )
    key = np.asarray(layer["key"])  # [kvh, b, t, d]
    assert key[:, 0, :3].any() and key[:, 1, 0].any()  # what was fed was written ...
    assert not key[:, 0, 3:].any() and not key[:, 1, 1:].any() and not key[:, 2].any()  # ... only


def test_paged_cache_rejects_bad_sizes():
    with pytest.raises(ValueError, match="page_size: must be at least 1"):
        build(lm_cfg("paged_kv_cache:page_size=0"))


# ------------------------------------------------------------------------------- sampling


DRAWS = 4000  # every test's number of draws: one program for all


@jax.jit
def _draws(logits, temperature, top_k, top_p, min_p):
    """DRAWS tokens sampled from `logits`, draw i with key i."""
    keys = jax.vmap(jax.random.PRNGKey)(jnp.arange(DRAWS))
    return sample_tokens(
        jnp.broadcast_to(logits, (DRAWS, len(logits))),
        keys,
        jnp.full((DRAWS,), temperature, jnp.float32),
        jnp.full((DRAWS,), top_k, jnp.int32),
        jnp.full((DRAWS,), top_p, jnp.float32),
        jnp.full((DRAWS,), min_p, jnp.float32),
    )


def _sample(logits, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0):
    logits = jnp.asarray(logits, jnp.float32)
    return np.asarray(_draws(logits, float(temperature), top_k, float(top_p), float(min_p)))


def test_temperature_zero_is_argmax_and_sampling_follows_softmax():
    logits = np.log(np.array([0.1, 0.6, 0.05, 0.25]))
    assert (_sample(logits, temperature=0.0) == 1).all()
    draws = _sample(logits)
    freq = np.bincount(draws, minlength=4) / len(draws)
    np.testing.assert_allclose(freq, [0.1, 0.6, 0.05, 0.25], atol=0.03)
    hot = np.bincount(_sample(logits, temperature=2.0), minlength=4) / DRAWS
    want = np.sqrt([0.1, 0.6, 0.05, 0.25])  # p^(1/T), T = 2
    np.testing.assert_allclose(hot, want / want.sum(), atol=0.03)


def test_top_k_and_top_p_restrict_the_support():
    probs = np.array([0.05, 0.4, 0.1, 0.3, 0.15])
    logits = np.log(probs)
    assert set(_sample(logits, top_k=2)) == {1, 3}
    # Nucleus 0.75: 0.4 + 0.3 = 0.7 < 0.75, so 0.15 (index 4) joins; 0.85 >= 0.75 stops.
    top_p = _sample(logits, top_p=0.75)
    assert set(top_p) == {1, 3, 4}
    freq = np.bincount(top_p, minlength=5)[[1, 3, 4]] / len(top_p)
    np.testing.assert_allclose(freq, np.array([0.4, 0.3, 0.15]) / 0.85, atol=0.03)
    assert set(_sample(logits, top_k=3, top_p=0.5)) == {1, 3}
    assert (_sample(logits, top_k=1) == 1).all()
    # min-p 0.5: tokens at least half as likely as the most likely (0.4) stay: 0.4, 0.3.
    min_p = _sample(logits, min_p=0.5)
    assert set(min_p) == {1, 3}
    np.testing.assert_allclose(np.bincount(min_p, minlength=5)[[1, 3]] / DRAWS, [4 / 7, 3 / 7],
                               atol=0.03)  # fmt: skip


def test_sampling_params_are_checked():
    expected = r"temperature=-1 must be a finite number >= 0.*top_p=1.5 must be in \(0, 1\]"
    with pytest.raises(ValueError, match=expected):
        SamplingParams(top_p=1.5, temperature=-1)
    with pytest.raises(ValueError, match="max_new_tokens=0"):
        SamplingParams(max_new_tokens=0)
    with pytest.raises(ValueError, match=r"top_k=2147483648 must be in \[0, 2147483647\]"):
        SamplingParams(top_k=2**31)
    with pytest.raises(ValueError, match="seed=18446744073709551616 must be a 64-bit integer"):
        SamplingParams(seed=2**64)
    with pytest.raises(ValueError, match="logprobs=-1 must be >= 0"):
        SamplingParams(logprobs=-1)


# ------------------------------------------------------------------- engine and batching


# The references below feed forward passes REF_LEN tokens, zero-padded (causal: the tail is
# unseen): one program for every length.
REF_LEN = 16


def padded(ids) -> np.ndarray:
    """`ids` as one row of REF_LEN tokens, zeros after them."""
    tokens = np.zeros((1, REF_LEN), np.int32)
    tokens[0, : len(ids)] = ids
    return tokens


def greedy_reference(model, params, prompt, new_tokens):
    """Greedy continuation by a full forward pass per token: no cache at all."""
    tokens = padded(prompt)
    for t in range(len(prompt), len(prompt) + new_tokens):
        logits = forward_logits(model, params, tokens)
        tokens[0, t] = int(jnp.argmax(logits[0, t - 1]))
    return tokens[0, len(prompt) : len(prompt) + new_tokens].tolist()


ROPE_MODS = ("rope", "gqa:num_kv_heads=2") if _installed("axplug-attention") else ()

# The engines of the tests below (and of `generate` there): 3 rows of 16 tokens, every prefill
# 16 wide. A request decoded alone runs by itself in an engine of this shape over the same
# model: the batched run's programs, so the references trace and compile nothing new.
BATCHING_ENGINE = dict(num_slots=3, max_len=16)


def batching_engine(model, params, **kwargs):
    return Engine(model, params, **BATCHING_ENGINE, min_prefill_len=16, **kwargs)


@pytest.fixture(scope="module")
def rope_model():
    return build(lm_cfg(*ROPE_MODS), seed=3)


@pytest.fixture(scope="module")
def rope_with(rope_model):
    """`rope_with(*cache)`: rope_model's model with those cache modifiers, one instance per
    cache in this module, so the engines over it share their programs across tests."""
    models = {(): rope_model[0]}

    def model_with(*cache):
        if cache not in models:
            models[cache] = lm_cfg(*ROPE_MODS, *cache).instantiate(parent=None)
        return models[cache]

    return model_with


def test_greedy_generation_equals_a_forward_pass_per_token(rope_model):
    model, params = rope_model
    prompts = [random_ids(5, 7).tolist(), random_ids(6, 3).tolist()]
    greedy = SamplingParams(max_new_tokens=6, temperature=0)
    done = generate(model, params, prompts, greedy, **BATCHING_ENGINE)
    for prompt, completion in zip(prompts, done, strict=True):
        assert completion.prompt_ids == prompt and completion.finish_reason == "length"
        assert completion.output_ids == greedy_reference(model, params, prompt, 6)


def test_stop_tokens_end_generation_without_the_stop_token(rope_model):
    model, params = rope_model
    prompt = random_ids(5, 7).tolist()
    greedy = SamplingParams(max_new_tokens=6, temperature=0)
    free = generate(model, params, [prompt], greedy, **BATCHING_ENGINE)[0]
    stop = free.output_ids[2]
    first = free.output_ids.index(stop)
    stopping = SamplingParams(max_new_tokens=6, temperature=0, stop_tokens=[stop])
    stopped = generate(model, params, [prompt], stopping, **BATCHING_ENGINE)[0]
    assert stopped.finish_reason == "stop" and stopped.output_ids == free.output_ids[:first]


REQUESTS = [  # (arrival step, prompt length, sampling)
    (0, 5, SamplingParams(max_new_tokens=6, temperature=0)),
    (0, 9, SamplingParams(max_new_tokens=3, temperature=0.8, seed=1)),
    (0, 2, SamplingParams(max_new_tokens=8, temperature=1.0, top_k=5, seed=2)),
    (2, 4, SamplingParams(max_new_tokens=5, temperature=0.7, top_p=0.9, seed=3)),
    (3, 12, SamplingParams(max_new_tokens=4, temperature=0)),
    (7, 1, SamplingParams(max_new_tokens=7, temperature=1.2, seed=4)),
]


def alone(engine, prompt, sampling):
    """`prompt` decoded by `engine` with no other request in it."""
    assert not engine.has_work
    engine.submit(Request(prompt, sampling))
    (completion,) = engine.run()
    return completion.output_ids


_BATCHING_CACHES = {
    "contiguous": (),
    "paged": ("paged_kv_cache:page_size=4,num_pages=9",),
    # 10 pages of 2 tokens for 3 rows of up to 15: rows grow page by page and the newest
    # is preempted (and recomputed) when the pool runs dry.
    "paged-preempting": ("paged_kv_cache:page_size=2,num_pages=10",),
}


@pytest.mark.parametrize(
    "cache, chunk",
    [
        pytest.param(
            modifiers,
            chunk,
            id=f"{prompts}-{name}",
            # Whole prompts are the chunked case's easier half: by default only the
            # preempting pool runs them (the other two take ~20 s each).
            marks=[pytest.mark.slow] if chunk is None and name != "paged-preempting" else [],
        )
        for chunk, prompts in ((None, "whole-prompts"), (3, "chunked-prefill"))
        for name, modifiers in _BATCHING_CACHES.items()
    ],
)
def test_continuous_batching_outputs_equal_decoding_each_request_alone(
    rope_model, rope_with, cache, chunk
):
    params = rope_model[1]
    model = rope_with(*cache)
    engine = batching_engine(model, params, prefill_chunk=chunk)
    prompts = {i: random_ids(10 + i, n).tolist() for i, (_, n, _) in enumerate(REQUESTS)}
    pending = list(enumerate(REQUESTS))
    finished, step, max_active = {}, 0, 0
    while pending or engine.has_work:
        while pending and pending[0][1][0] <= step:
            i, (_, _, sampling) = pending.pop(0)
            engine.submit(Request(prompts[i], sampling, id=i))
        engine.step()
        max_active = max(max_active, engine.num_active)
        finished |= {c.id: c for c in engine.pop_finished()}
        step += 1
    assert max_active == 3  # requests really shared the batch
    if engine.allocator is not None:
        assert engine.allocator.num_free == engine.allocator.num_pages  # all pages came back
        assert (engine.preemptions > 0) == ("num_pages=10" in cache[0])
    one = batching_engine(model, params)  # whole prompts, one request at a time
    for i, (_, _, sampling) in enumerate(REQUESTS):
        want = alone(one, prompts[i], sampling)
        assert finished[i].output_ids == want, i
        assert len(want) == sampling.max_new_tokens


SCORED = [  # (prompt length, sampling): logprobs of sampled and prompt tokens
    (6, SamplingParams(max_new_tokens=5, temperature=0, logprobs=3, prompt_logprobs=2)),
    (9, SamplingParams(max_new_tokens=4, temperature=0.9, seed=7, logprobs=0)),
    (5, SamplingParams(max_new_tokens=0, prompt_logprobs=1)),  # score the prompt only
    (11, SamplingParams(max_new_tokens=3, temperature=1.0, top_k=2**31 - 1, prompt_logprobs=0)),
    (3, SamplingParams(max_new_tokens=6, temperature=0.5, top_p=0.8, seed=2, logprobs=1)),
]


def _reference_logprobs(model, params, ids: list[int]) -> np.ndarray:
    """log-softmax of one forward pass's logits over `ids`: row t predicts ids[t + 1]."""
    logits = forward_logits(model, params, padded(ids))[0]
    return np.asarray(jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1))[: len(ids)]


def _assert_logprob(entry, want: np.ndarray, token: int, top_n: int):
    assert entry.token == token
    np.testing.assert_allclose(entry.logprob, want[token], rtol=0, atol=1e-5)
    assert entry.rank == 1 + int(np.sum(want > want[token]))
    order = np.argsort(-want, kind="stable")[:top_n]
    assert [t for t, _ in entry.top] == order.tolist()
    np.testing.assert_allclose([v for _, v in entry.top], want[order], rtol=0, atol=1e-5)


# The contiguous cache and the preempting pool: the `paged` cache (4-token pages, never dry)
# reads its pages by the preempting pool's path (2-token pages, rows preempted and recomputed).
_SCORED_CACHES = ("contiguous", "paged-preempting")


@pytest.mark.parametrize(
    "cache, chunk",
    [(_BATCHING_CACHES[name], chunk) for chunk in (None, 3) for name in _SCORED_CACHES],
    ids=[f"{c}-{name}" for c in ("whole", "chunked") for name in _SCORED_CACHES],
)
def test_logprobs_equal_the_forward_pass_log_softmax(rope_model, rope_with, cache, chunk):
    # The reference is the forward pass of the model without a cache modifier (a KV cache
    # only changes decoding).
    plain, params = rope_model
    model = rope_with(*cache)
    # Every prefill (whole prompts, chunks) 16 wide: the cases over one model share programs.
    engine = batching_engine(model, params, prefill_chunk=chunk)
    prompts = [random_ids(40 + i, n).tolist() for i, (n, _) in enumerate(SCORED)]
    for i, (prompt, (_, sampling)) in enumerate(zip(prompts, SCORED, strict=True)):
        engine.submit(Request(prompt, sampling, id=i))
    done = {c.id: c for c in engine.run()}
    for i, (_, sampling) in enumerate(SCORED):
        completion = done[i]
        assert len(completion.output_ids) == sampling.max_new_tokens
        want = _reference_logprobs(plain, params, completion.prompt_ids + completion.output_ids)
        prompt = completion.prompt_ids
        if sampling.prompt_logprobs is None:
            assert completion.prompt_logprobs is None
        else:
            assert len(completion.prompt_logprobs) == len(prompt)
            assert completion.prompt_logprobs[0] is None
            for t in range(1, len(prompt)):
                entry = completion.prompt_logprobs[t]
                _assert_logprob(entry, want[t - 1], prompt[t], sampling.prompt_logprobs)
        if sampling.logprobs is None:
            assert completion.output_logprobs is None
            continue
        assert len(completion.output_logprobs) == len(completion.output_ids)
        for j, token in enumerate(completion.output_ids):
            entry = completion.output_logprobs[j]
            _assert_logprob(entry, want[len(prompt) + j - 1], token, sampling.logprobs)
    if engine.allocator is not None:
        assert engine.allocator.num_free == engine.allocator.num_pages


def test_logprobs_ride_on_token_events_and_are_bounded(rope_model):
    model, params = rope_model
    bounded = Engine(model, params, num_slots=1, max_len=16, max_logprobs=4)
    with pytest.raises(ValueError, match=r"logprobs=5 asks for more top tokens than this "
                       r"engine's max_logprobs \(4\)"):  # fmt: skip
        bounded.submit(Request([1, 2], SamplingParams(logprobs=5)))
    # The events on an engine of the logprobs tests' shape (and max_logprobs): their programs.
    engine = batching_engine(model, params)
    engine.submit(Request([1, 2, 3], SamplingParams(max_new_tokens=3, temperature=0, logprobs=2)))
    events = [e for _ in range(4) for e in engine.step()]
    (completion,) = engine.pop_finished()
    assert [e.logprob for e in events] == completion.output_logprobs
    assert all(len(e.logprob.top) == 2 for e in events)
    # Greedy: the chosen token is the most likely one.
    assert all(e.logprob.top[0][0] == e.token for e in events)
    with pytest.raises(ValueError, match="max_new_tokens=0 must be at least 1 .0 only to score"):
        SamplingParams(max_new_tokens=0)


PENALIZED = [  # greedy, so the reference is an argmax of penalized forward-pass logits
    SamplingParams(max_new_tokens=8, temperature=0, presence_penalty=1.5),
    SamplingParams(max_new_tokens=8, temperature=0, frequency_penalty=1.0, logit_bias=[(7, 3.0)]),
    SamplingParams(max_new_tokens=8, temperature=0, repetition_penalty=1.8),
    SamplingParams(max_new_tokens=8, temperature=0),  # batched with them, unpenalized
]


def _penalized_reference(model, params, prompt, sampling):
    """Greedy tokens from one forward pass per token, penalized in numpy (float64)."""
    tokens = padded(prompt)
    out = []
    for t in range(len(prompt), len(prompt) + sampling.max_new_tokens):
        logits = np.asarray(forward_logits(model, params, tokens)[0, t - 1], np.float64)
        counts = np.bincount(out, minlength=len(logits))
        logits -= sampling.presence_penalty * (counts > 0) + sampling.frequency_penalty * counts
        seen = np.zeros(len(logits), bool)
        seen[tokens[0, :t]] = True
        rp = sampling.repetition_penalty
        logits = np.where(seen, np.where(logits > 0, logits / rp, logits * rp), logits)
        for token, bias in sampling.logit_bias:
            logits[token] += bias
        out.append(int(np.argmax(logits)))
        tokens[0, t] = out[-1]
    return out


@pytest.mark.parametrize(
    "cache, chunk",
    [((), None), (_BATCHING_CACHES["paged-preempting"], 3)],
    ids=["contiguous-whole", "paged-preempting-chunked"],
)
def test_penalties_and_logit_bias_equal_a_penalized_forward_pass(
    rope_model, rope_with, cache, chunk
):
    plain_model, params = rope_model  # the reference's forward pass: no cache modifier
    model = rope_with(*cache)
    engine = batching_engine(model, params, prefill_chunk=chunk)
    prompts = [random_ids(60 + i, 4 + i).tolist() for i in range(len(PENALIZED))]
    for i, (prompt, sampling) in enumerate(zip(prompts, PENALIZED, strict=True)):
        engine.submit(Request(prompt, sampling, id=i))
    done = {c.id: c.output_ids for c in engine.run()}
    plain = SamplingParams(max_new_tokens=8, temperature=0)
    for i, (prompt, sampling) in enumerate(zip(prompts, PENALIZED, strict=True)):
        assert done[i] == _penalized_reference(plain_model, params, prompt, sampling), i
        if sampling.penalizes:  # the penalty changed something, so this test can fail
            assert done[i] != _penalized_reference(plain_model, params, prompt, plain), i
    if "num_pages=10" in str(cache):
        assert engine.preemptions > 0  # recomputed rows rebuilt their counts
    with pytest.raises(ValueError, match="logit_bias token id 61 is outside the vocabulary"):
        engine.submit(Request([1], SamplingParams(logit_bias=[(61, 1.0)])))
    with pytest.raises(ValueError, match=r"logit_bias \(3, 200.0\): ids must be >= 0"):
        SamplingParams(logit_bias={3: 200})


def test_decoding_rows_keep_producing_tokens_while_a_long_prompt_is_prefilled(rope_model):
    model, params = rope_model
    engine = batching_engine(model, params, prefill_chunk=4)
    greedy = SamplingParams(max_new_tokens=10, temperature=0)
    brief = SamplingParams(max_new_tokens=4, temperature=0)  # 12 + 4 tokens: max_len
    short, long = random_ids(31, 2).tolist(), random_ids(32, 12).tolist()
    engine.submit(Request(short, greedy, id="short"))
    assert [e.id for e in engine.step()] == ["short"]  # prefilled: its first token
    engine.submit(Request(long, brief, id="long"))
    per_step = [[e.id for e in engine.step()] for _ in range(4)]
    # 12 prompt tokens in chunks of 4: three steps, each also decoding "short" (after the
    # one that ran ahead of the request's arrival).
    assert per_step == [["short"], ["short"], ["short"], ["short", "long"]]
    done = {c.id: c.output_ids for c in engine.run()}
    one = batching_engine(model, params)  # whole prompts, one request at a time
    assert done["long"] == alone(one, long, brief)
    assert done["short"] == alone(one, short, greedy)
    with pytest.raises(ValueError, match="prefill_chunk=0 must be >= 1"):
        Engine(model, params, prefill_chunk=0)


def test_engine_rejects_bad_requests(rope_model):
    model, params = rope_model
    engine = Engine(model, params, num_slots=2, max_len=8)
    with pytest.raises(ValueError, match="request 'a': the prompt is empty"):
        engine.submit(Request([], id="a"))
    with pytest.raises(ValueError, match=r"token id 61 is outside the vocabulary \[0, 61\)"):
        engine.submit([1, 61])
    with pytest.raises(ValueError, match="need 10 cache slots but the engine's max_len is 8"):
        engine.submit(Request([1] * 5, SamplingParams(max_new_tokens=6)))
    paged = lm_cfg("paged_kv_cache:page_size=2,num_pages=3").instantiate(parent=None)
    with pytest.raises(OutOfPagesError, match="needs 4 pages of 2 tokens, the pool has 3"):
        Engine(paged, params, num_slots=2, max_len=8).submit(
            Request([1] * 4, SamplingParams(max_new_tokens=4))
        )


def test_cancel_frees_the_row_and_pages_and_leaves_the_others_alone(rope_model, rope_with):
    params = rope_model[1]
    # 9 pages of 4: each of the 3 rows holds up to 3 (4 + 6 tokens), no preemption.
    paged = rope_with(*_BATCHING_CACHES["paged"])
    engine = batching_engine(paged, params)
    greedy = SamplingParams(max_new_tokens=6, temperature=0)
    prompts = {name: random_ids(20 + i, 4).tolist() for i, name in enumerate("abcd")}
    for name, prompt in prompts.items():
        engine.submit(Request(prompt, greedy, id=name))
    engine.step()  # a, b and c prefilled; d waits
    engine.step()
    assert (engine.num_active, engine.num_waiting) == (3, 1)
    assert engine.cancel("d") and engine.num_waiting == 0  # waiting: dropped
    assert engine.cancel("a") and engine.num_active == 2  # running: its row is free
    assert not engine.cancel("a") and not engine.cancel("nobody")
    done = {c.id: c for c in [*engine.pop_finished(), *engine.run()]}
    assert (done["a"].finish_reason, len(done["a"].output_ids)) == ("cancelled", 2)
    assert (done["d"].finish_reason, done["d"].output_ids) == ("cancelled", [])
    one = batching_engine(paged, params)
    for name in "bc":
        assert done[name].output_ids == alone(one, prompts[name], greedy), name
    assert engine.allocator.num_free == engine.allocator.num_pages


def test_engines_over_one_model_share_their_programs_and_free_the_model(rope_model, monkeypatch):
    import gc
    import weakref

    from axplug.inference import steps

    traced, extend_rows = [], steps.extend_rows
    monkeypatch.setattr(steps, "extend_rows", lambda *args: traced.append(1) or extend_rows(*args))
    # A model of its own (traced afresh here), of rope_model's config: the programs the
    # other tests compiled for engines of this shape.
    model, params = lm_cfg(*ROPE_MODS).instantiate(parent=None), rope_model[1]
    outputs = []
    for _ in range(2):  # an engine made again, as for each round of rollouts
        engine = batching_engine(model, params)
        engine.submit(Request([1, 2, 3], SamplingParams(max_new_tokens=3, temperature=0)))
        outputs.append(engine.run()[0].output_ids)
    assert outputs[0] == outputs[1] and len(traced) == 2  # a prefill and a decode, traced once
    freed = weakref.ref(model)
    del model, params, engine
    gc.collect()
    assert freed() is None  # the shared programs do not keep a dead engine's model alive


@pytest.mark.parametrize("seed", [0, 1, 12345, 2**31 - 1, 2**32 - 1])
def test_request_keys_are_jax_prng_keys(seed):
    from axplug.inference.requests import seed_key

    np.testing.assert_array_equal(seed_key(seed), np.asarray(jax.random.PRNGKey(seed)))


def test_page_allocator_allocates_and_releases():
    pool = PageAllocator(4)
    a = pool.allocate(3)
    assert len(set(a)) == 3 and pool.num_free == 1
    with pytest.raises(OutOfPagesError, match="need 2 pages, 1 of 4 are free"):
        pool.allocate(2)
    assert pool.num_free == 1  # a failed allocation takes nothing
    pool.release(a)
    assert sorted(pool.allocate(4)) == [0, 1, 2, 3]


# --------------------------------------------------------------- checkpoints and the CLI


@pytest.fixture
def trained_run(gpt_tiny_trained):
    """The session's gpt-tiny run, read only (the test that edits one copies it first)."""
    return str(gpt_tiny_trained)


@pytest.fixture(scope="module")
def loaded_run(gpt_tiny_trained):
    """load_checkpoint of the session's gpt-tiny run, once for the tests that only read it (and
    its engines' programs, traced once)."""
    return load_checkpoint(str(gpt_tiny_trained))


def test_load_checkpoint_and_generate_cli(trained_run, loaded_run, capsys):
    loaded = loaded_run
    assert loaded.step == 2 and loaded.vocab_size == 256
    prompt = list(b"To be")
    want = generate(
        loaded.model, loaded.params, [prompt], SamplingParams(max_new_tokens=5, temperature=0)
    )[0].output_ids
    args = ["generate", "--checkpoint", trained_run, "--max-new-tokens", "5", "--temperature", "0"]
    assert main([*args, "--prompt-ids", ",".join(map(str, prompt)), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out == {"prompt_ids": prompt, "output_ids": want}
    assert main([*args, "--prompt", "To be"]) == 0
    assert capsys.readouterr().out == "To be" + bytes(want).decode("utf-8", "replace") + "\n"


def test_a_loaded_runs_logits_are_its_forward_pass_and_lead_to_its_greedy_token(loaded_run):
    loaded = loaded_run
    ids = random_ids(9, (2, 7))
    got = loaded.logits(ids)
    assert got.shape == (2, 7, loaded.vocab_size) and got.dtype == np.float32
    np.testing.assert_allclose(got, forward_logits(loaded.model, loaded.params, ids), **LOOSE)
    greedy = SamplingParams(max_new_tokens=1, temperature=0)
    # max_len 10: the engine of `axplug generate` in the test above (5 + 5 tokens), its program.
    (first,) = generate(loaded.model, loaded.params, [ids[1].tolist()], greedy, max_len=10)
    assert first.output_ids == [int(np.argmax(got[1, -1]))]


def test_load_checkpoint_reads_parameters_only(trained_run, monkeypatch):
    """The optimizer state (2x the parameters with Adam) is not asked of Orbax at all, and
    the parameters equal a full restore's."""
    import orbax.checkpoint as ocp

    from axplug.checkpoint import Checkpointer, checkpoint_directory

    asked = []
    real = ocp.args.PyTreeRestore

    def spy(item=None, **kwargs):
        read = {
            k for k, v in item.items() if any(x is not ocp.PLACEHOLDER for x in jax.tree.leaves(v))
        }
        asked.append((sorted(item), sorted(read)))
        return real(item=item, **kwargs)

    monkeypatch.setattr(ocp.args, "PyTreeRestore", spy)
    loaded = load_checkpoint(trained_run)
    # The whole saved tree is named, the optimizer state (and step) only by placeholders.
    assert asked == [(["opt_state", "params", "step"], ["params"])]
    monkeypatch.undo()
    with (
        Checkpointer.default_config()
        .set(directory=checkpoint_directory(trained_run))
        .instantiate() as ckpt
    ):
        full = ckpt.restore(2, target=jax.eval_shape(lambda: _full_state(loaded)))[1]
    jax.tree.map(
        np.testing.assert_array_equal, jax.device_get(loaded.params), jax.device_get(full["params"])
    )


def _full_state(loaded):
    """The trainer's whole state for `loaded`'s config: params, Adam state, step."""
    specs = loaded.model.create_parameter_specs_recursively()
    tx = loaded.config.learner.instantiate().transform(specs, loaded.config.max_steps)
    return {"params": loaded.params, "opt_state": tx.init(loaded.params), "step": jnp.int32(0)}


def test_a_partial_restore_still_checks_what_it_reads(trained_run, loaded_run):
    from axplug.checkpoint import Checkpointer, CheckpointError, checkpoint_directory

    loaded = loaded_run
    wrong = jax.tree.map(lambda a: jax.ShapeDtypeStruct((*a.shape, 2), a.dtype), loaded.params)
    with (
        Checkpointer.default_config()
        .set(directory=checkpoint_directory(trained_run))
        .instantiate() as ckpt,
        pytest.raises(CheckpointError, match="holds a different state"),
    ):
        ckpt.restore(2, target={"params": wrong}, partial=True)


def test_generate_cli_errors(trained_run, tmp_path, capsys):
    assert main(["generate", "--checkpoint", str(tmp_path), "--prompt", "x"]) == 1
    assert "no complete checkpoint" in capsys.readouterr().err
    assert main(["generate", "--checkpoint", trained_run, "--prompt-ids", "1,x"]) == 2
    assert "--prompt-ids" in capsys.readouterr().err
    assert main(["generate", "--checkpoint", trained_run, "--prompt-ids", "1,999"]) == 2
    assert "token id 999 is outside the vocabulary" in capsys.readouterr().err


def test_generate_refuses_code_named_in_checkpoint_metadata(trained_run, tmp_path, capsys):
    """Crafted metadata in a copied run dir: `os:abort` as a config class is refused, not run."""
    import os
    import shutil

    from axplug.checkpoint import layout

    run = tmp_path / "crafted"
    shutil.copytree(trained_run, run)
    (step_dir,) = (run / "checkpoints").glob("step_*")
    meta = step_dir / layout.METADATA_ITEM / layout.METADATA_FILE
    data = json.loads(meta.read_text())
    data["config"]["model"]["config_class"] = "os:abort"
    meta.write_text(json.dumps(data))
    aborted = []
    original, os.abort = os.abort, lambda: aborted.append(True)
    try:
        code = main(["generate", "--checkpoint", str(run), "--prompt", "x"])
    finally:
        os.abort = original
    assert code == 2 and not aborted  # an error exit, not SIGABRT (134)
    err = capsys.readouterr().err
    assert "model.config_class: 'os:abort' names code outside axplug" in err


def test_generate_checks_what_it_is_asked_for(trained_run, capsys):
    args = ["generate", "--checkpoint", trained_run, "--prompt", "x"]
    assert main([*args, "--max-new-tokens", "1000000000"]) == 2
    err = capsys.readouterr().err
    assert "--max-new-tokens: a 1000000001-token sequence needs a" in err
    assert "trained on 32-token sequences" in err
    assert main([*args, "--temperature", "nan"]) == 2
    assert "temperature=nan must be a finite number >= 0" in capsys.readouterr().err
