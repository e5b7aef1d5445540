"""Speculative decoding in the Engine: the verification rule against the distributions it must
preserve, and decoding with proposals equal to decoding without them."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from axplug.inference import Engine, Proposer, Request, SamplingParams, verify_drafts
from axplug.layers import CausalLM
from axplug.modifiers import make_modifier

VOCAB = 5
SAMPLES = 40_000


def _verify_many(logits, drafts, temperature=1.0, top_k=0):
    """verify_drafts of one row under SAMPLES keys: (tokens [S, K+1], accepted [S])."""
    temperature, top_k = jnp.asarray([temperature], jnp.float32), jnp.asarray([top_k], jnp.int32)
    tokens, accepted = _verify_under_keys(logits, drafts, temperature, top_k)
    return np.asarray(tokens), np.asarray(accepted)


@jax.jit
def _verify_under_keys(logits, drafts, temperature, top_k):
    """The settings traced, not constants: one program for every test's [3, V] logits and
    2 drafts."""
    k = drafts.shape[0]

    def one(key):
        tokens, accepted = verify_drafts(
            logits[None], drafts[None], jnp.asarray([k]), key[None], jnp.asarray([0]),
            temperature, top_k, jnp.asarray([1.0]), jnp.asarray([0.0]),
        )  # fmt: skip
        return tokens[0], accepted[0]

    return jax.vmap(one)(jax.random.split(jax.random.PRNGKey(0), SAMPLES))


def _frequencies(tokens):
    return np.bincount(tokens, minlength=VOCAB) / len(tokens)


def _total_variation(p, q):
    return 0.5 * float(np.abs(np.asarray(p) - np.asarray(q)).sum())


@pytest.mark.parametrize("top_k", [0, 3])
def test_sampled_verification_keeps_the_targets_distribution(top_k):
    """Whatever the drafts, the first emitted token follows the target's distribution at the
    last token (softmax of the logits, cut to the top k), and the next one, given that the
    first draft was taken, the distribution at that draft (Leviathan et al., Theorem 1)."""
    host = (np.random.default_rng(0).normal(size=(3, VOCAB)) * 1.5).astype(np.float32)
    logits = jnp.asarray(host)

    def target(row):  # in numpy: no op compiled per row
        kept = host[row] if not top_k else np.where(
            host[row] >= np.sort(host[row])[-top_k], host[row], -np.inf)  # fmt: skip
        p = np.exp(kept - kept.max())
        return p / p.sum()

    # A likely first draft and an unlikely second one: both branches of the rule are taken.
    drafts = np.asarray([np.argsort(target(0))[-2], np.argmin(target(1))], np.int32)
    tokens, accepted = _verify_many(logits, jnp.asarray(drafts), top_k=top_k)
    assert _total_variation(_frequencies(tokens[:, 0]), target(0)) < 0.01
    took_first = tokens[:, 0] == int(drafts[0])
    assert took_first.sum() > 5_000
    assert _total_variation(_frequencies(tokens[took_first, 1]), target(1)) < 0.015
    # A draft is taken with its probability: the first one about p0(d1) of the time.
    assert abs((accepted >= 1).mean() - target(0)[int(drafts[0])]) < 0.01
    if top_k:
        cut = np.argsort(target(0))[:-top_k]
        assert not np.isin(tokens[:, 0], cut).any()


def test_greedy_verification_takes_drafts_while_they_are_the_argmax():
    # The sampled test's shapes (3 positions, 2 drafts): its program.
    logits = jnp.asarray(np.random.default_rng(1).normal(size=(3, VOCAB)), jnp.float32)
    best = np.argmax(np.asarray(logits), -1)
    wrong = (best[1] + 1) % VOCAB
    for drafts, accepted, emitted in [
        ([best[0], best[1]], 2, [best[0], best[1], best[2]]),  # all, + bonus
        ([best[0], wrong], 1, [best[0], best[1]]),  # the target's token at the miss
        ([(best[0] + 1) % VOCAB, best[1]], 0, [best[0]]),
    ]:
        tokens, got = _verify_many(logits, jnp.asarray(drafts, jnp.int32), temperature=0.0)
        assert (got == accepted).all()
        assert (tokens[:, : accepted + 1] == emitted).all()


class Replay(Proposer):
    """Proposes the next tokens of a known continuation (`script`), with every `wrong`-th
    guess replaced: a stand-in for a proposer that is often right and sometimes not."""

    def __init__(self, cfg, script: dict[tuple, list[int]], wrong: int = 3):
        super().__init__(cfg)
        self.script, self.wrong, self.calls = script, wrong, 0

    def propose(self, contexts, limits):
        out = {}
        for row, context in contexts.items():
            for prompt, continuation in self.script.items():
                if tuple(context[: len(prompt)]) == prompt:
                    done = len(context) - len(prompt)
                    guess = list(continuation[done : done + limits[row]])
                    self.calls += 1
                    if guess and self.calls % self.wrong == 0:
                        guess[-1] = (guess[-1] + 1) % 61
                    out[row] = guess
        return out


@pytest.fixture(scope="module")
def models():
    cfg = CausalLM.default_config()
    cfg.decoder.set(vocab_size=61, dim=32)
    cfg.decoder.transformer.set(num_layers=2)
    cfg.decoder.transformer.layer.attention.set(num_heads=4)
    cfg.decoder.transformer.layer.feed_forward.set(hidden_dim=64)
    contiguous = cfg.instantiate(parent=None)
    params = contiguous.initialize_parameters_recursively(jax.random.PRNGKey(3))
    paged = make_modifier("paged_kv_cache:page_size=4,num_pages=40")(cfg).instantiate(parent=None)
    return {"contiguous": contiguous, "paged": paged}, params


def _decode(model, params, requests, proposer=None):
    engine = Engine(model, params, num_slots=3, max_len=40, speculative=proposer)
    for i, (prompt, sampling) in enumerate(requests):
        engine.submit(Request(prompt, sampling, id=i))
    done = {c.id: c for c in engine.run()}
    return [done[i] for i in range(len(requests))], engine


@pytest.mark.parametrize("cache", ["contiguous", "paged"])
def test_greedy_decoding_with_drafts_equals_decoding_without(models, cache):
    """Drafts that are mostly right (some wrong, some cut by max_new_tokens or a stop token):
    the same tokens, finish reasons and log-probabilities as plain decoding, fewer steps."""
    by_cache, params = models
    model = by_cache[cache]
    rng = np.random.default_rng(0)
    greedy = SamplingParams(max_new_tokens=12, temperature=0, logprobs=2)
    prompts = [rng.integers(1, 61, n).tolist() for n in (5, 9, 3, 6)]
    want, plain = _decode(model, params, [(p, greedy) for p in prompts])
    stop = SamplingParams(max_new_tokens=12, temperature=0, logprobs=2,
                          stop_tokens=(want[3].output_ids[7],))  # fmt: skip
    requests = [(p, greedy) for p in prompts[:3]] + [(prompts[3], stop)]
    script = {tuple(p): c.output_ids for p, c in zip(prompts, want, strict=True)}
    proposer = Replay(Proposer.Config().set(num_tokens=3), script)
    got, engine = _decode(model, params, requests, proposer)
    for g, w in zip(got[:3], want[:3], strict=True):
        assert (g.output_ids, g.finish_reason) == (w.output_ids, w.finish_reason)
        for a, b in zip(g.output_logprobs, w.output_logprobs, strict=True):
            assert (a.token, a.rank, [t for t, _ in a.top]) == (
                b.token,
                b.rank,
                [t for t, _ in b.top],
            )
            np.testing.assert_allclose(a.logprob, b.logprob, atol=1e-5)
    assert got[3].output_ids == want[3].output_ids[:7] and got[3].finish_reason == "stop"
    assert 0 < engine.accepted_tokens < engine.proposed_tokens
    if cache == "paged":
        assert engine.allocator.num_free == engine.allocator.num_pages


def test_sampled_decoding_with_drafts_is_reproducible(models):
    by_cache, params = models
    # With log-probabilities and 3 drafts, as the greedy test's paged case: its programs.
    sampling = SamplingParams(max_new_tokens=10, temperature=1.0, top_k=8, seed=4, logprobs=1)
    prompts = [[3, 4, 5, 3, 4], [7, 8, 9]]
    plain, _ = _decode(by_cache["paged"], params, [(p, sampling) for p in prompts])
    script = {tuple(p): c.output_ids for p, c in zip(prompts, plain, strict=True)}

    def run():
        proposer = Replay(Proposer.Config().set(num_tokens=3), script)
        return _decode(by_cache["paged"], params, [(p, sampling) for p in prompts], proposer)

    (first, engine), (again, _) = run(), run()
    assert [c.output_ids for c in first] == [c.output_ids for c in again]
    assert all(len(c.output_ids) == 10 for c in first) and engine.accepted_tokens > 0


def test_a_proposer_that_is_not_installed_is_named(models):
    by_cache, params = models
    with pytest.raises(LookupError, match="no proposers component named 'no-such-proposer'"):
        Engine(by_cache["paged"], params, speculative="no-such-proposer")
