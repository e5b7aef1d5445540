"""Speculative decoding in the Engine: tokens/s and acceptance against plain decoding.

    python bench/serve.py speculative [--batch 1,8] [--new-tokens 64] [--rounds 5]

llama-tiny (4 layers) with random parameters, a paged cache, greedy, on a repetitive workload:
each prompt is a random 12-token phrase said four times (random weights also fall into loops
of their own, as small models do). Proposers (4 tokens a step): `ngram` (prompt lookup),
`draft` (the target's first layer, embedding and head as a 1-layer draft: cheap and often
right, as a distilled draft is), and `draft=target` (the target proposing for itself: every
draft accepted, the bound on what verification saves). Each round runs every setting on the
same prompts, interleaved; tokens must equal plain decoding's (checked). Prints decode tokens/s
(median [min-max]), the ratio to plain decoding, and the acceptance rate (accepted/proposed).
"""

from __future__ import annotations

import statistics
import time
import types

import jax
import numpy as np

from axplug.inference import Engine, Request, SamplingParams
from axplug.modifiers import make_modifier
from axplug.presets import preset_config


def _decode(engine, prompts, new_tokens):
    """(ids, seconds) of `engine` decoding `prompts` greedily to the end."""
    sampling = SamplingParams(max_new_tokens=new_tokens, temperature=0)
    ids = [engine.submit(Request(p, sampling)) for p in prompts]
    start = time.perf_counter()
    done = {c.id: c.output_ids for c in engine.run()}
    return [done[i] for i in ids], time.perf_counter() - start


def bench_speculative(args) -> None:
    from axplug_speculative import DraftProposer, NgramProposer

    cfg = make_modifier("paged_kv_cache:page_size=16")(preset_config(args.preset).model)
    model = cfg.instantiate(parent=None)
    params = model.initialize_parameters_recursively(jax.random.PRNGKey(0))
    small = cfg.clone()
    small.decoder.transformer.num_layers = 1
    draft_model = small.instantiate(parent=None)
    layers = params["decoder"]["transformer"]
    draft_params = {**params, "decoder": {**params["decoder"], "transformer": {
        "layer0": layers["layer0"]}}}  # fmt: skip
    vocab = cfg.decoder.vocab_size
    rng = np.random.default_rng(0)
    batches = [int(b) for b in args.batch.split(",")]
    prompts = [rng.integers(0, vocab, 12).tolist() * 4 for _ in range(max(batches))]
    max_len = 48 + args.new_tokens + args.num_tokens

    def proposers():
        k = args.num_tokens
        draft = DraftProposer.default_config().set(num_tokens=k)
        return {
            "plain": None,
            "ngram": NgramProposer.default_config().set(num_tokens=k).instantiate(),
            "draft": DraftProposer(
                draft,
                draft=types.SimpleNamespace(
                    model=draft_model, params=draft_params, vocab_size=vocab
                ),
            ),  # fmt: skip
            "draft=target": DraftProposer(
                draft, draft=types.SimpleNamespace(model=model, params=params, vocab_size=vocab)
            ),  # fmt: skip
        }

    print(
        f"{args.preset}, paged cache, greedy, {args.num_tokens} proposed tokens a step, "
        f"{args.new_tokens} new tokens after 48-token repetitive prompts; jax {jax.__version__} "
        f"on {jax.devices()[0].platform}; median [min-max] of {args.rounds} rounds"
    )
    print(f"{'setting':<24}{'tok/s':>24}{'x plain':>10}{'accepted':>10}")
    for batch in batches:
        rows = prompts[:batch]
        engines = {
            name: Engine(model, params, num_slots=batch, max_len=max_len, speculative=p)
            for name, p in proposers().items()
        }
        rates: dict[str, list[float]] = {name: [] for name in engines}
        equal = True
        for r in range(args.rounds + 1):  # round 0 compiles
            order = list(engines) if r % 2 else list(reversed(engines))
            outs = {}
            for name in order:
                outs[name], seconds = _decode(engines[name], rows, args.new_tokens)
                if r:
                    rates[name].append(batch * args.new_tokens / seconds)
            equal &= all(out == outs["plain"] for out in outs.values())
        plain = statistics.median(rates["plain"])
        for name, values in rates.items():
            engine = engines[name]
            rate = statistics.median(values)
            accepted = (f"{engine.accepted_tokens / engine.proposed_tokens:.2f}"
                        if engine.proposed_tokens else "-")  # fmt: skip
            spread = f"{rate:.0f} [{min(values):.0f}-{max(values):.0f}]"
            print(f"{name + f' batch {batch}':<24}{spread:>24}{rate / plain:>10.2f}{accepted:>10}")
        print(f"batch {batch}: tokens equal to plain decoding: {equal}")


def add_parser(sub) -> None:
    p = sub.add_parser("speculative", help="speculative decoding: tokens/s and acceptance")
    p.add_argument("--preset", default="llama-tiny")
    p.add_argument("--batch", default="1,8", help="batch sizes, comma-separated")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--num-tokens", type=int, default=4, help="proposed tokens a step")
    p.add_argument("--rounds", type=int, default=5)
