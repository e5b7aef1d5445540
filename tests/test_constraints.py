"""Constrained decoding in the Engine: a request's TokenConstraint limits each sampled token to
what it allows, rows without one decode as before, and the mask's bit layout and sampling
from a masked row against plain numpy."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from axplug.inference import (
    Engine,
    Proposer,
    Request,
    SamplingParams,
    TokenConstraint,
    sample_tokens,
)
from axplug.inference.constraints import allowed_tokens, mask_words
from test_inference import ROPE_MODS, build, forward_logits, lm_cfg, padded, random_ids

VOCAB = 61
DRAWS = 4000


def words_of(tokens, vocab: int = VOCAB) -> np.ndarray:
    """Mask words allowing `tokens`, built bit by bit in numpy."""
    words = np.zeros(mask_words(vocab), np.uint32)
    for t in tokens:
        words[t // 32] |= np.uint32(1) << np.uint32(t % 32)
    return words.view(np.int32)


class FixedSets(TokenConstraint):
    """Allows `sets[i]` as the ith generated token; complete after the last."""

    def __init__(self, sets):
        self.sets, self.accepted = [sorted(s) for s in sets], []

    def fill(self, words):
        words[:] = words_of(self.sets[len(self.accepted)])

    def accept(self, token):
        assert token in self.sets[len(self.accepted)], (token, self.sets[len(self.accepted)])
        self.accepted.append(token)
        return len(self.accepted) == len(self.sets)


def masked_greedy_reference(model, params, prompt, sets):
    """Greedy continuation by a full forward pass per token, each the argmax over its set."""
    tokens = padded(prompt)
    for i, allowed in enumerate(sets):
        t = len(prompt) + i
        logits = np.asarray(forward_logits(model, params, tokens))[0, t - 1]
        tokens[0, t] = sorted(allowed)[int(np.argmax(logits[sorted(allowed)]))]
    return tokens[0, len(prompt) : len(prompt) + len(sets)].tolist()


def test_mask_words_set_one_bit_per_allowed_token():
    logits = jnp.asarray(np.random.default_rng(0).normal(size=(2, VOCAB)), jnp.float32)
    allowed = [{0, 31, 32, 60}, set(range(VOCAB))]
    words = np.stack([words_of(allowed[0]), words_of(allowed[1])])
    out = np.asarray(jax.jit(allowed_tokens)(logits, words))  # one program, not one per op
    for row, tokens in enumerate(allowed):
        keep = np.isin(np.arange(VOCAB), sorted(tokens))
        np.testing.assert_array_equal(out[row][keep], np.asarray(logits)[row][keep])
        assert np.all(np.isneginf(out[row][~keep]))


def test_sampling_a_masked_row_follows_the_renormalized_softmax():
    probs = np.array([0.05, 0.4, 0.1, 0.3, 0.15])
    logits = np.log(np.pad(probs, (0, 27))).astype(np.float32)  # 32 tokens, one word
    words = words_of({0, 2, 4}, 32)[None]

    @jax.jit  # the mask and the draws in one program
    def draws(logits, words):
        row = allowed_tokens(logits[None], words)[0]
        keys = jax.vmap(jax.random.PRNGKey)(jnp.arange(DRAWS))
        rows = jnp.broadcast_to(row, (DRAWS, row.shape[0]))
        ones = jnp.ones((DRAWS,), jnp.float32)
        return sample_tokens(rows, keys, ones, jnp.zeros((DRAWS,), jnp.int32), ones)

    freq = np.bincount(np.asarray(draws(logits, words)), minlength=32) / DRAWS
    want = np.zeros(32)
    want[[0, 2, 4]] = probs[[0, 2, 4]] / probs[[0, 2, 4]].sum()
    np.testing.assert_allclose(freq, want, atol=0.03)


@pytest.fixture(scope="module")
def model_and_params():
    return build(lm_cfg(*ROPE_MODS), seed=3)


@pytest.mark.parametrize(
    "modifiers, chunk",
    [((), None), (("paged_kv_cache:page_size=4,num_pages=12",), 3)],
    ids=["contiguous", "paged-chunked"],
)
def test_constrained_rows_take_the_best_allowed_token_and_others_are_unchanged(
    model_and_params, modifiers, chunk
):
    model, params = model_and_params
    if modifiers:
        model = lm_cfg(*ROPE_MODS, *modifiers).instantiate(parent=None)
    rng = np.random.default_rng(1)
    sets = [[set(rng.choice(VOCAB, 5, replace=False).tolist()) for _ in range(4)] for _ in "ab"]
    prompts = [random_ids(5, 7).tolist(), random_ids(6, 3).tolist(), random_ids(7, 5).tolist()]
    greedy = SamplingParams(max_new_tokens=6, temperature=0)
    engine = Engine(model, params, num_slots=3, max_len=16, min_prefill_len=16,
                    prefill_chunk=chunk)  # fmt: skip
    engine.submit(Request(prompts[0], greedy, id="a", constraint=FixedSets(sets[0])))
    engine.submit(Request(prompts[1], greedy, id="free"))
    sampled = SamplingParams(max_new_tokens=6, temperature=1.0, seed=5)
    engine.submit(Request(prompts[2], sampled, id="b", constraint=FixedSets(sets[1])))
    done = {c.id: c for c in engine.run()}
    assert done["a"].finish_reason == "stop" and done["b"].finish_reason == "stop"
    assert done["a"].output_ids == masked_greedy_reference(model, params, prompts[0], sets[0])
    assert [t in s for t, s in zip(done["b"].output_ids, sets[1], strict=True)] == [True] * 4
    # The unconstrained row decodes as it does with no constraint in the engine.
    engine.submit(Request(prompts[1], greedy, id="alone"))
    assert done["free"].output_ids == engine.run()[0].output_ids


class Ones(Proposer):
    """Proposes token 1 for every row it is asked about, and remembers their contexts."""

    def propose(self, contexts, limits):
        self.contexts = [*getattr(self, "contexts", []), *contexts.values()]
        return {s: [1] * limits[s] for s in contexts}


def test_constrained_rows_take_no_drafts_and_decode_as_without_speculation(model_and_params):
    model, params = model_and_params
    sets = [set(np.random.default_rng(2).choice(VOCAB, 4, replace=False).tolist())] * 5
    prompts = [random_ids(8, 6).tolist(), random_ids(9, 4).tolist()]
    greedy = SamplingParams(max_new_tokens=6, temperature=0)
    proposer = Ones.default_config().set(num_tokens=2).instantiate()
    engine = Engine(model, params, num_slots=3, max_len=16, min_prefill_len=16,
                    speculative=proposer)  # fmt: skip
    engine.submit(Request(prompts[0], greedy, id="guided", constraint=FixedSets(sets)))
    engine.submit(Request(prompts[1], greedy, id="free"))
    done = {c.id: c for c in engine.run()}
    assert done["guided"].output_ids == masked_greedy_reference(model, params, prompts[0], sets)
    assert done["free"].output_ids == masked_greedy_reference(
        model, params, prompts[1], [range(VOCAB)] * 6
    )
    assert proposer.contexts and all(c[: len(prompts[0])] != prompts[0] for c in proposer.contexts)


def test_a_constraint_needs_the_vocabulary(model_and_params):
    model, params = model_and_params
    engine = Engine(model, params, num_slots=1, max_len=16)
    engine.vocab_size = None  # a model whose config does not say
    with pytest.raises(ValueError, match="a constraint needs the model's vocab_size"):
        engine.submit(Request([1, 2], constraint=FixedSets([{1}])))
