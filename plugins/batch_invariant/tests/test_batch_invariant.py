"""axplug-batch-invariant: a token's numbers do not depend on what shares its step. Prefix
caching on and off, chunked prefill, `n > 1`, preemption and a request alone give the same
tokens and bit-identical log-probabilities; the layers equal plain-jnp references."""

from __future__ import annotations

import re

import pytest

pytest.importorskip("axplug_batch_invariant")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from axplug_batch_invariant import attend_each_query, tiled_matmul  # noqa: E402
from axplug_testing import random_params  # noqa: E402

from axplug.api.config import ConfigError, make_modifier  # noqa: E402
from axplug.api.layers import AttentionKernelSlot, BaseLayer, CausalLM, Linear  # noqa: E402
from axplug.api.run import Engine, Request, SamplingParams  # noqa: E402

VOCAB, PAGE, PAGES = 61, 4, 12


def test_tiled_matmul_equals_matmul_and_a_rows_bits_ignore_the_others():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((100, 32)).astype(np.float32)  # rows taken on the host: no op each
    w = jnp.asarray(rng.standard_normal((32, 96)), jnp.float32)
    f = jax.jit(tiled_matmul)
    np.testing.assert_allclose(f(x, w), jnp.asarray(x) @ w, rtol=1e-5, atol=1e-5)
    alone = np.asarray(f(x[:1], w))[0]
    for m in (2, 9, 56, 100):  # plain matmuls of these row counts differ in the last bits
        assert np.array_equal(np.asarray(f(x[:m], w))[0], alone), m
    assert f(x.reshape(4, 25, 32), w).shape == (4, 25, 96)


def _reference(q, k, v, allowed, scale, bias, cap):
    """softmax over the allowed keys in plain jnp (heads grouped by repetition)."""
    k, v = (jnp.repeat(t, q.shape[2] // t.shape[2], axis=2) for t in (k, v))
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) * scale
    s = cap * jnp.tanh(s / cap) + bias
    s = jnp.where(allowed[:, None], s, -jnp.inf)
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, axis=-1), v)


def test_each_query_attention_equals_softmax_attention_with_groups_bias_and_cap():
    # Both jitted (as in a model) and the inputs made on the host: a program per call, not an
    # op-by-op compile of every op.
    attend = jax.jit(attend_each_query, static_argnames=("scale", "logit_softcap"))
    reference = jax.jit(_reference, static_argnums=(4, 6))
    rng = np.random.default_rng(1)
    b, sq, skv, h, kvh, d = 2, 5, 12, 4, 2, 8
    q, k, v = (rng.standard_normal(s).astype(np.float32)
               for s in ((b, sq, h, d), (b, skv, kvh, d), (b, skv, kvh, d)))  # fmt: skip
    allowed = rng.random((b, sq, skv)) < 0.6
    allowed[:, :, 0] = True
    bias = rng.standard_normal((b, h, sq, skv)).astype(np.float32)
    got = attend(q, k, v, allowed, scale=0.3, bias=bias, logit_softcap=5.0)
    want = reference(q, k, v, allowed, 0.3, bias, 5.0)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    v6 = v[..., :6]  # values narrower than queries and keys (MLA)
    got = attend(q, k, v6, allowed, scale=0.3, bias=bias, logit_softcap=5.0)
    np.testing.assert_allclose(got, reference(q, k, v6, allowed, 0.3, bias, 5.0), atol=1e-5)
    empty = attend(q, k, v, np.zeros_like(allowed), scale=0.3)
    assert not np.any(np.asarray(empty))  # a query that sees no key gives zeros, not NaN


def _tiny_lm():
    """A two-layer CausalLM config over a 61-token vocabulary."""
    cfg = CausalLM.default_config()
    cfg.decoder.set(vocab_size=VOCAB, dim=32)
    cfg.decoder.transformer.set(num_layers=2)
    cfg.decoder.transformer.layer.attention.set(num_heads=4)
    cfg.decoder.transformer.layer.feed_forward.set(hidden_dim=64)
    return cfg


@pytest.fixture(scope="module")
def model_and_params():
    cfg = make_modifier(f"paged_kv_cache:page_size={PAGE},num_pages={PAGES}")(_tiny_lm())
    plain = cfg.instantiate(parent=None)
    invariant = make_modifier("batch_invariant")(cfg).instantiate(parent=None)
    return plain, invariant, random_params(plain, seed=3)


def _ids(seed, n):
    return np.random.default_rng(seed).integers(1, VOCAB, n).tolist()


# Two full pages and one token of a third (4 tokens a page). Every prompt (9 + 3..6 tokens)
# and chunk is one 16-wide prefill; only a preempted row's recompute (prompt and output) is
# 32 wide: few programs per engine shape.
SYSTEM = _ids(0, 9)
SAMPLINGS = [
    SamplingParams(max_new_tokens=6, temperature=0, logprobs=2),
    SamplingParams(max_new_tokens=5, temperature=0.9, seed=1, logprobs=1),
    SamplingParams(max_new_tokens=7, temperature=1.0, top_k=5, seed=2, logprobs=1),
    SamplingParams(max_new_tokens=4, temperature=0.7, top_p=0.9, seed=3, logprobs=1),
]
# Two choices of one prompt (`n = 2`: the server submits each as a request of its own).
CHOICES = [SamplingParams(max_new_tokens=6, temperature=1.0, seed=s, logprobs=1) for s in (7, 8)]


def _run(model, params, requests, arrivals, **engine):
    """({request: [(token, logprob bits, top logprob bits)]}, engine) through one Engine,
    request i submitted at step arrivals[i]. Prefills are 16 or 32 wide, decode steps 1."""
    engine = Engine(model, params, max_len=32, min_prefill_len=16, **engine)
    pending, out, step = sorted(range(len(requests)), key=arrivals.__getitem__), {}, 0
    while pending or engine.has_work:
        while pending and arrivals[pending[0]] <= step:
            i = pending.pop(0)
            engine.submit(Request(requests[i][0], requests[i][1], id=i))
        engine.step()
        for c in engine.pop_finished():
            out[c.id] = [
                (
                    p.token,
                    np.float32(p.logprob).tobytes(),
                    [np.float32(v).tobytes() for _, v in p.top],
                )
                for p in c.output_logprobs
            ]
        step += 1
    assert engine.allocator is None or engine.allocator.num_free == engine.allocator.num_pages
    return out, engine


def test_logprobs_are_bit_identical_with_the_cache_on_and_off_chunked_preempted_or_alone(
    model_and_params,
):
    """Shared system prompt, n = 2, arrivals over time, whole or chunked prefill, a pool so
    small it preempts: every setting gives the same tokens and the same logprob bits; the
    plain layers do not (a step's width changes their sums in the last bits)."""
    plain, invariant, params = model_and_params
    requests = [(SYSTEM + _ids(10 + i, 3 + i), s) for i, s in enumerate(SAMPLINGS)]
    requests += [(SYSTEM + _ids(9, 6), s) for s in CHOICES]
    arrivals = [0, 3, 3, 12, 5, 5]
    want, _ = _run(invariant, params, requests, arrivals, num_slots=3, prefix_caching=False)
    for engine in (
        dict(num_slots=3, prefix_caching=True),
        dict(num_slots=3, prefix_caching=True, prefill_chunk=5),
        dict(num_slots=3, prefix_caching=False, prefill_chunk=3),
    ):
        got, _ = _run(invariant, params, requests, arrivals, **engine)
        assert got == want, engine
    # Twice the requests at once in six rows: 12 pages make the pool share, evict and preempt.
    got, used = _run(invariant, params, requests * 2, [0] * 12, num_slots=6)
    assert got == {i: want[i % len(requests)] for i in range(2 * len(requests))}
    assert used.prefix_hit_tokens > 0 and used.preemptions > 0
    for i in (0, 2):  # alone in a one-row engine
        alone, _ = _run(invariant, params, [requests[i]], [0], num_slots=1)
        assert alone == {0: want[i]}, i
    chunked, _ = _run(plain, params, requests, arrivals, num_slots=3, prefill_chunk=3)
    assert chunked != _run(plain, params, requests, arrivals, num_slots=3)[0]


def test_the_modifier_refuses_what_it_cannot_make_invariant():
    """Another kernel, a subclass of a swapped layer (quantized), an adapter, a feed-forward
    block of another kind (MoE): one error naming where, never a silent plain layer."""

    class OtherKernel(AttentionKernelSlot):
        pass

    class OtherLinear(Linear):
        pass

    class OtherBlock(BaseLayer):
        pass

    cases = {
        "decoder.transformer.layer.attention.kernel (OtherKernel)": (
            "attention",
            "kernel",
            OtherKernel,
        ),
        "decoder.lm_head (OtherLinear)": ("decoder", "lm_head", OtherLinear),
        "decoder.transformer.layer.feed_forward (OtherBlock)": (
            "layer",
            "feed_forward",
            OtherBlock,
        ),
        "decoder.lm_head.adapter (OtherBlock)": ("lm_head", "adapter", OtherBlock),
    }
    for where, (parent, field, klass) in cases.items():
        cfg = _tiny_lm()
        layer = cfg.decoder.transformer.layer
        owners = {"decoder": cfg.decoder, "layer": layer, "attention": layer.attention,
                  "lm_head": cfg.decoder.lm_head}  # fmt: skip
        setattr(owners[parent], field, klass.default_config())
        with pytest.raises(ConfigError, match=re.escape(where) + " has no batch-invariant form"):
            make_modifier("batch_invariant")(cfg)
    make_modifier("batch_invariant")(make_modifier("batch_invariant")(_tiny_lm()))  # twice: fine
