"""Prefix caching in the paged Engine: full pages named by their prefix's digest, shared
read-only, reference-counted and evicted least recently used; every request decodes exactly
the tokens it decodes without the cache."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from axplug.inference import Engine, OutOfPagesError, PageAllocator, Request, SamplingParams
from axplug.layers import CausalLM
from axplug.modifiers import make_modifier

PAGE = 4


@pytest.fixture(scope="module")
def model_and_params():
    cfg = CausalLM.default_config()
    cfg.decoder.set(vocab_size=61, dim=32)
    cfg.decoder.transformer.set(num_layers=2)
    cfg.decoder.transformer.layer.attention.set(num_heads=4)
    cfg.decoder.transformer.layer.feed_forward.set(hidden_dim=64)
    cfg = make_modifier(f"paged_kv_cache:page_size={PAGE},num_pages=24")(cfg)
    model = cfg.instantiate(parent=None)
    return model, model.initialize_parameters_recursively(jax.random.PRNGKey(3))


def _ids(seed, n):
    return np.random.default_rng(seed).integers(1, 61, n).tolist()


SYSTEM = _ids(0, 13)  # three full pages and one token of a fourth
SAMPLINGS = [
    SamplingParams(max_new_tokens=6, temperature=0, logprobs=2),
    SamplingParams(max_new_tokens=5, temperature=0.9, seed=1, logprobs=0),
    SamplingParams(max_new_tokens=7, temperature=1.0, top_k=5, seed=2),
    SamplingParams(max_new_tokens=4, temperature=0.7, top_p=0.9, seed=3, logprobs=1),
]


def _run(model, params, requests, *, caching, arrivals=None, chunk=None):
    """{id: (output ids, their log-probabilities)} of `requests` ([(prompt, sampling)])
    through one engine; request i is submitted at step `arrivals[i]` (all at once by
    default); prompts are prefilled `chunk` tokens a step (whole by default)."""
    engine = Engine(model, params, num_slots=3, max_len=32, min_prefill_len=8,
                    prefill_chunk=chunk, prefix_caching=caching)  # fmt: skip
    arrivals = arrivals or [0] * len(requests)
    pending, outputs, step = sorted(range(len(requests)), key=arrivals.__getitem__), {}, 0
    while pending or engine.has_work:
        while pending and arrivals[pending[0]] <= step:
            i = pending.pop(0)
            engine.submit(Request(requests[i][0], requests[i][1], id=i))
        engine.step()
        outputs |= {c.id: (c.output_ids, _scores(c)) for c in engine.pop_finished()}
        step += 1
    assert engine.allocator.num_free == engine.allocator.num_pages  # every hold came back
    return outputs, engine


def _scores(completion):
    """Each output token's (rank, top ids, [its logprob, the top logprobs])."""
    return [(p.rank, [i for i, _ in p.top], [p.logprob, *(v for _, v in p.top)])
            for p in completion.output_logprobs or ()]  # fmt: skip


def _assert_same(got, want):
    """Equal ids, ranks and top ids; log-probabilities within 1e-5: a step's program width
    differs with what shares the step, and XLA's float32 sums with it (by ~1e-7, with or
    without the cache). axplug-batch-invariant's test asserts the same bits."""
    assert got.keys() == want.keys()
    for i in want:
        assert got[i][0] == want[i][0], i
        assert [s[:2] for s in got[i][1]] == [s[:2] for s in want[i][1]], i
        for g, w in zip(got[i][1], want[i][1], strict=True):
            np.testing.assert_allclose(g[2], w[2], atol=1e-5, rtol=0)


@pytest.mark.parametrize("chunk", [None, 5])
def test_requests_sharing_a_system_prompt_reuse_its_full_pages(model_and_params, chunk):
    """Four requests after one system prompt, arriving over time: each later one reads the
    prompt's three full pages from the cache (never its partial fourth), and every output
    and log-probability equals the uncached engine's, prompts whole or in chunks."""
    model, params = model_and_params
    requests = [(SYSTEM + _ids(10 + i, 3 + i), s) for i, s in enumerate(SAMPLINGS)]
    arrivals = [0, 3, 3, 12]
    want, plain = _run(model, params, requests, caching=False, arrivals=arrivals, chunk=chunk)
    got, cached = _run(model, params, requests, caching=True, arrivals=arrivals, chunk=chunk)
    _assert_same(got, want)
    assert plain.prefix_hit_tokens == 0
    assert cached.prefix_hit_tokens == 3 * 3 * PAGE  # the three later requests, 3 pages each
    assert cached.prompt_tokens == plain.prompt_tokens == sum(len(p) for p, _ in requests)


def test_completions_of_one_prompt_prefill_it_once(model_and_params):
    """G completions of one prompt submitted together (RL rollouts, `n` choices): one row
    computes the prompt's full pages while the others wait a step, then they share them.
    G = 3, a row each: the other tests' engine shape, so their programs."""
    model, params = model_and_params
    prompt = _ids(5, 18)  # four full pages; the last two tokens are fed by every row
    requests = [(prompt, SamplingParams(max_new_tokens=5, temperature=1.0, seed=s))
                for s in range(3)]  # fmt: skip
    want, _ = _run(model, params, requests, caching=False)
    got, engine = _run(model, params, requests, caching=True)
    _assert_same(got, want)
    assert len({tuple(v) for v, _ in got.values()}) > 1  # sampled apart
    assert engine.prefix_hit_tokens == 2 * 4 * PAGE  # the two rows that waited, 4 pages each
    assert engine.allocator.num_cached >= 4


def test_a_small_pool_evicts_the_least_recently_used_and_outputs_stay_exact(model_and_params):
    """24 pages for requests whose prompts (and outputs) fill more: idle cached pages are
    evicted, oldest first, rows are preempted and recomputed, and nothing changes a token."""
    model, params = model_and_params
    requests = [(_ids(20 + i % 3, 14) + _ids(30 + i, 2), s)
                for i, s in enumerate(SAMPLINGS * 2)]  # fmt: skip
    arrivals = [2 * i for i in range(len(requests))]
    want, _ = _run(model, params, requests, caching=False, arrivals=arrivals)
    got, engine = _run(model, params, requests, caching=True, arrivals=arrivals)
    _assert_same(got, want)
    assert engine.allocator.evictions > 0 and engine.prefix_hit_tokens > 0


def test_scored_and_penalized_requests_compute_their_prompts(model_and_params):
    """Prompt log-probabilities need every prompt position's logits, and penalties count the
    prompt's tokens: such requests read no cached page (and still fill the cache)."""
    model, params = model_and_params
    scored = SamplingParams(max_new_tokens=3, temperature=0, prompt_logprobs=0)  # 0: asked
    penalized = SamplingParams(max_new_tokens=3, temperature=0, presence_penalty=1.0)
    requests = [(SYSTEM + [5], SAMPLINGS[0]), (SYSTEM + [6], scored), (SYSTEM + [7], penalized)]
    want, _ = _run(model, params, requests, caching=False, arrivals=[0, 4, 8])
    got, engine = _run(model, params, requests, caching=True, arrivals=[0, 4, 8])
    _assert_same(got, want)
    assert engine.prefix_hit_tokens == 0


def test_the_allocator_shares_counts_holds_and_evicts_oldest_first():
    pool = PageAllocator(4, page_size=2, caching=True)
    tokens = [1, 2, 3, 4, 5]
    digests = pool.digests(tokens, [])
    assert len(digests) == 2  # full pages only: [1, 2], [3, 4]
    assert pool.digests([1, 2, 9, 9], [])[0] == digests[0] != pool.digests([9, 9, 3, 4], [])[1]
    # A salt (an image's features from position 3 on) changes the page holding its position
    # and every page after it, never one before: text ahead of an image stays shared.
    six = [1, 2, 3, 4, 5, 6]
    salted = pool.digests(six, [], [(3, b"image")])
    assert salted[0] == pool.digests(six, [])[0] and salted[1:] != pool.digests(six, [])[1:]
    assert pool.digests(six, [], [(3, b"other")])[1:] != salted[1:]
    a = pool.allocate(2)
    for page, digest in zip(a, digests, strict=True):
        pool.register(page, digest)
    assert pool.share(digests) == a and pool.num_free == 2  # held twice now
    pool.release(a)
    assert pool.num_free == 2  # still held once
    pool.release(a)
    assert pool.num_free == 4 and pool.num_cached == 2  # idle, still cached
    assert pool.share(digests[1:]) == [a[1]]  # any run of digests from its first
    pool.release([a[1]])
    b = pool.allocate(3)  # two free pages, then the least recently used idle one: a[0]
    assert a[0] in b and pool.evictions == 1 and pool.share(digests) == []
    with pytest.raises(OutOfPagesError, match="need 2 pages, 1 of 4 are free"):
        pool.allocate(2)
    assert pool.num_free == 1  # nothing taken


def test_pages_are_given_from_a_rows_own_run_where_free():
    """`first`: a row's own pages (so an unshared pool stays in row order and paged reads
    need no gather); taken or cached ones are skipped for the free list's."""
    pool = PageAllocator(8, page_size=2, caching=True)
    assert pool.allocate(2, first=4) == [4, 5]
    held = pool.allocate(1)  # the free list's first: 0
    pool.register(held[0], pool.digests([1, 2], [])[0])
    pool.release(held)  # idle and cached: kept for sharing, not handed out as "free"
    assert pool.allocate(3, first=5) == [1, 6, 7] and pool.evictions == 0
    assert pool.allocate(1, first=0) == [2]  # 0 is cached: the free list's next


def test_without_caching_nothing_is_shared():
    pool = PageAllocator(2, page_size=1)
    (page,) = pool.allocate(1)
    digest = pool.digests([7], [])[0]
    pool.register(page, digest)
    assert pool.share([digest]) == [] and pool.num_cached == 0
    pool.release([page])
    assert pool.num_free == 2


def test_a_requests_salts_start_at_its_adapter_and_its_first_embedded_token():
    from axplug.inference.requests import RequestState

    where, vectors = np.array([5, 6, 9]), np.ones((3, 4), np.float32)
    plain = RequestState(Request(list(range(12)), embeddings=(where, vectors)), 0.0)
    ((at, salt),) = plain.prefix_salt
    assert at == 5 and len(salt) == 16
    other = RequestState(Request(list(range(12)), embeddings=(where, 2 * vectors), adapter=2), 0.0)
    assert other.prefix_salt[0] == (0, (2).to_bytes(4, "little"))
    assert other.prefix_salt[1][0] == 5 and other.prefix_salt[1][1] != salt
