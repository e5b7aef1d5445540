"""Prefix caching in the Engine: time to first token after a shared prefix, and `n` choices.

    python bench/serve.py prefix [--prefix-len 1024] [--suffix-len 16] [--requests 6]
                                 [--n 8] [--rounds 5]

llama-tiny with random parameters, a paged cache (16-token pages), greedy. Each round, for
the Engine with prefix caching on and off (interleaved):
- `shared prefix`: `--requests` prompts of one `--prefix-len`-token prefix and their own
  `--suffix-len` tokens, one after another (each alone, as a chat's turns or a system prompt's
  users arrive); the time to first token of the second and later ones;
- `n choices`: `--n` sampled completions of one prompt submitted together (an OpenAI `n`, RL's
  G completions); the prompt tokens the engine computed and the time until every choice has
  its first token.
Prints medians with min-max over rounds, the cached/uncached ratios, and checks that both
engines give the same tokens.
"""

from __future__ import annotations

import statistics
import time

import jax
import numpy as np

from axplug.inference import Engine, Request, SamplingParams
from axplug.modifiers import make_modifier
from axplug.presets import preset_config


def _first_tokens(engine, requests) -> tuple[float, list]:
    """Seconds until every request has its first token, and the completions' ids."""
    ids = [engine.submit(r) for r in requests]
    start, pending = time.perf_counter(), set(ids)
    while pending:
        pending -= {e.id for e in engine.step() if e.token is not None}
    seconds = time.perf_counter() - start
    while engine.has_work:
        engine.step()
    done = {c.id: c.output_ids for c in engine.pop_finished()}
    return seconds, [done[i] for i in ids]


def bench_prefix(args) -> None:
    cfg = make_modifier("paged_kv_cache:page_size=16")(preset_config(args.preset).model)
    model = cfg.instantiate(parent=None)
    params = model.initialize_parameters_recursively(jax.random.PRNGKey(0))
    vocab = cfg.decoder.vocab_size
    rng = np.random.default_rng(0)
    prefix = rng.integers(0, vocab, args.prefix_len).tolist()
    suffixes = [rng.integers(0, vocab, args.suffix_len).tolist() for _ in range(args.requests)]
    max_len = args.prefix_len + args.suffix_len + args.new_tokens
    greedy = SamplingParams(max_new_tokens=args.new_tokens, temperature=0)
    print(
        f"{args.preset}, paged cache (16-token pages), jax {jax.__version__} on "
        f"{jax.devices()[0].platform}: {args.requests} requests after one {args.prefix_len}-token "
        f"prefix (+{args.suffix_len} tokens each, one at a time); n={args.n} choices of one "
        f"prompt; median [min-max] of {args.rounds} rounds"
    )
    engines = {
        caching: Engine(model, params, num_slots=args.n, max_len=max_len, prefix_caching=caching)
        for caching in (True, False)
    }
    ttft: dict[bool, list[float]] = {True: [], False: []}
    n_time: dict[bool, list[float]] = {True: [], False: []}
    computed: dict[bool, int] = {}
    outputs: dict[bool, list] = {}
    for r in range(args.rounds + 1):  # round 0 compiles every shape
        for caching in (True, False) if r % 2 else (False, True):
            engine = engines[caching]
            # A new prefix per round: the cache starts cold for the first request.
            head = [(t + r) % vocab for t in prefix]
            seconds, outs = [], []
            for suffix in suffixes:
                s, (out,) = _first_tokens(engine, [Request(head + suffix, greedy)])
                seconds.append(s)
                outs.append(out)
            before = engine.prompt_tokens - engine.prefix_hit_tokens
            sampled = [SamplingParams(max_new_tokens=args.new_tokens, temperature=1.0, seed=i)
                       for i in range(args.n)]  # fmt: skip
            prompt = [(t + r + 1) % vocab for t in prefix] + suffixes[0]
            n_seconds, n_outs = _first_tokens(engine, [Request(prompt, s) for s in sampled])
            if r == 0:
                continue
            ttft[caching].extend(seconds[1:])
            n_time[caching].append(n_seconds)
            computed[caching] = engine.prompt_tokens - engine.prefix_hit_tokens - before
            outputs.setdefault(caching, []).append(outs + n_outs)

    def cell(values, scale=1e3):
        v = [x * scale for x in values]
        return f"{statistics.median(v):8.2f} [{min(v):.2f}-{max(v):.2f}]"

    for caching in (True, False):
        name = "prefix caching" if caching else "no caching"
        print(
            f"{name:<16} later requests' TTFT ms {cell(ttft[caching])}; n={args.n}: all first "
            f"tokens ms {cell(n_time[caching])}, prompt tokens computed {computed[caching]}"
        )
    ratio = statistics.median(ttft[False]) / statistics.median(ttft[True])
    n_ratio = statistics.median(n_time[False]) / statistics.median(n_time[True])
    one = len(prompt)
    print(f"shared prefix: later requests' TTFT {ratio:.1f}x lower with prefix caching")
    print(
        f"n={args.n}: {computed[True]} prompt tokens computed (one prompt: {one}; without "
        f"caching {computed[False]}), first tokens {n_ratio:.1f}x sooner"
    )
    print(f"tokens equal with and without caching: {outputs[True] == outputs[False]}")


def add_parser(sub) -> None:
    p = sub.add_parser("prefix", help="prefix caching: shared-prefix TTFT and n choices")
    p.add_argument("--preset", default="llama-tiny")
    p.add_argument("--prefix-len", type=int, default=1024)
    p.add_argument("--suffix-len", type=int, default=16)
    p.add_argument("--requests", type=int, default=6)
    p.add_argument("--n", type=int, default=8)
    p.add_argument("--new-tokens", type=int, default=4)
    p.add_argument("--rounds", type=int, default=5)
