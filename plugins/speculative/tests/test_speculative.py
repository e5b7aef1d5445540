"""axplug-speculative: n-gram and draft-model proposals through the core Engine's verification
give exactly the tokens of plain greedy decoding, with paged and contiguous caches."""

from __future__ import annotations

import pytest

pytest.importorskip("axplug_speculative")

import jax  # noqa: E402
import numpy as np  # noqa: E402
from axplug_speculative import DraftProposer, NgramProposer, lookup  # noqa: E402

from axplug.api.config import (
    ConfigError,  # noqa: E402
    make_modifier,  # noqa: E402
)
from axplug.api.layers import CausalLM  # noqa: E402
from axplug.api.run import Engine, Request, SamplingParams  # noqa: E402

VOCAB = 61


def _reference_lookup(context, count, max_n, min_n):
    """The same rule in plain Python: the latest earlier match of the longest suffix."""
    for n in range(min(max_n, len(context) - 1), min_n - 1, -1):
        suffix = context[-n:]
        for start in range(len(context) - n - 1, -1, -1):
            if context[start : start + n] == suffix:
                return context[start + n : start + n + count]
    return []


def test_lookup_finds_the_latest_longest_match():
    rng = np.random.default_rng(0)
    for _ in range(300):
        context = rng.integers(0, 4, rng.integers(1, 30)).tolist()
        for max_n, min_n in ((3, 1), (4, 2), (1, 1)):
            assert lookup(context, 3, max_n, min_n) == _reference_lookup(context, 3, max_n, min_n)
    assert lookup([1, 2, 3, 9, 1, 2, 3, 7, 1, 2, 3], 2, 3) == [7, 1]  # the latest occurrence
    assert lookup([5, 6, 7], 4, 2) == []


@pytest.fixture(scope="module")
def models():
    cfg = CausalLM.default_config()
    cfg.decoder.set(vocab_size=VOCAB, dim=32)
    cfg.decoder.transformer.set(num_layers=2)
    cfg.decoder.transformer.layer.attention.set(num_heads=4)
    cfg.decoder.transformer.layer.feed_forward.set(hidden_dim=64)
    # 40 pages of 4 and (below) 3 rows of 40 tokens: the shapes of the core's speculation tests
    # (tests/test_speculation.py), so the session compiles the plain and verifying programs once.
    paged_cfg = make_modifier("paged_kv_cache:page_size=4,num_pages=40")(cfg.clone())
    target = {
        "contiguous": cfg.instantiate(parent=None),
        "paged": paged_cfg.instantiate(parent=None),
    }
    params = target["paged"].initialize_parameters_recursively(jax.random.PRNGKey(3))
    # The draft: the same shape, other weights (so it is often wrong), one layer fewer.
    paged_cfg.decoder.transformer.set(num_layers=1)
    draft = paged_cfg.instantiate(parent=None)
    draft_params = draft.initialize_parameters_recursively(jax.random.PRNGKey(9))
    return target, params, draft, draft_params


class _Draft:
    """What DraftProposer reads of a loaded checkpoint."""

    def __init__(self, model, params):
        self.model, self.params, self.vocab_size = model, params, VOCAB


# Repetitive prompts (prompt lookup has something to find) and random ones.
PROMPTS = [[4, 5, 6, 7, 4, 5, 6, 7, 4, 5], [9, 10, 11, 12, 13, 9, 10], [30, 2, 17, 44, 8]]


def _decode(model, params, proposer=None):
    engine = Engine(model, params, num_slots=3, max_len=40, speculative=proposer)
    greedy = SamplingParams(max_new_tokens=16, temperature=0, logprobs=1)
    ids = [engine.submit(Request(p, greedy)) for p in PROMPTS]
    done = {c.id: c for c in engine.run()}
    return [done[i] for i in ids], engine


@pytest.mark.parametrize("cache", ["contiguous", "paged"])
def test_proposals_never_change_greedy_tokens(models, cache):
    target, params, draft, draft_params = models
    want, _ = _decode(target[cache], params)
    proposers = {
        "ngram": NgramProposer.default_config().set(num_tokens=3, min_n=1).instantiate(),
        "draft": DraftProposer(
            DraftProposer.default_config().set(num_tokens=3), draft=_Draft(draft, draft_params)
        ),  # fmt: skip
        "draft=target": DraftProposer(
            DraftProposer.default_config().set(num_tokens=4), draft=_Draft(target["paged"], params)
        ),  # fmt: skip
    }
    for name, proposer in proposers.items():
        got, engine = _decode(target[cache], params, proposer)
        assert [c.output_ids for c in got] == [c.output_ids for c in want], name
        for g, w in zip(got, want, strict=True):
            np.testing.assert_allclose(
                [p.logprob for p in g.output_logprobs],
                [p.logprob for p in w.output_logprobs],
                atol=1e-5,
            )
        assert engine.proposed_tokens > 0, name
        if name == "draft=target":  # the target proposing for itself: every draft is taken
            assert engine.accepted_tokens == engine.proposed_tokens
        elif name == "draft":
            assert engine.accepted_tokens < engine.proposed_tokens


def test_engines_load_proposers_by_spec_and_check_them(models):
    target, params, draft, _ = models
    engine = Engine(target["paged"], params, speculative="ngram:num_tokens=2,max_n=3")
    assert isinstance(engine.proposer, NgramProposer)
    with pytest.raises(ConfigError, match=r"speculative.min_n: must be in \[1, max_n=4\], not 6"):
        Engine(target["paged"], params, speculative="ngram:min_n=6")
    with pytest.raises(ConfigError, match="speculative.checkpoint: name the draft model's run"):
        Engine(target["paged"], params, speculative="draft")

    other = _Draft(draft, None)
    other.vocab_size = VOCAB + 1  # another tokenizer's
    proposer = DraftProposer(DraftProposer.default_config(), draft=other)
    with pytest.raises(ConfigError, match="the draft's vocabulary has 62 tokens, the target's 61"):
        Engine(target["paged"], params, speculative=proposer)
