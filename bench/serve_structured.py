"""Structured outputs in the Engine: what a constrained row costs, alone and in a mixed batch.

    python bench/serve.py structured [--batch 8] [--new-tokens 64] [--rounds 5]

llama-tiny with random parameters (its byte vocabulary), a paged cache, greedy. Each round
decodes `--batch` prompts of 32 tokens for `--new-tokens` tokens three ways, interleaved: every
row free, half the rows constrained (mixed), every row constrained. The constraint is
axplug-structured's llguidance guide with a regex of exactly `--new-tokens` characters, so
every row decodes the same number of tokens. Prints decode tokens/s (median, min-max) and its
ratio to the free batch, the host's mask time per constrained token, and the mask time per
token of a JSON schema (a nested one, walked along a valid document) for comparison.
"""

from __future__ import annotations

import json
import statistics
import time

import jax
import numpy as np

from axplug.api.data import ByteTokenizer
from axplug.inference import Engine, Request, SamplingParams
from axplug.modifiers import make_modifier
from axplug.presets import preset_config

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}},
        "scenes": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {"act": {"type": "integer"}, "mood": {"type": "string"}},
                "required": ["act"],
            },
        },  # fmt: skip
    },
    "required": ["name", "scenes"],
}
DOCUMENT = {"name": "Hamlet", "tags": ["a", "c"], "scenes": [{"act": 1, "mood": "grim"}] * 6}


class Timed:
    """A constraint that adds the seconds its `fill` calls take to `spent`."""

    def __init__(self, inner, spent: list):
        self.inner, self.spent = inner, spent

    def fill(self, words):
        start = time.perf_counter()
        self.inner.fill(words)
        self.spent.append(time.perf_counter() - start)

    def accept(self, token):
        return self.inner.accept(token)


def _decode(engine, prompts, guided, new_tokens, make, spent) -> float:
    """Decode tokens/s of one batch (after the step that prefills it)."""
    greedy = SamplingParams(max_new_tokens=new_tokens, temperature=0)
    for i, prompt in enumerate(prompts):
        constraint = Timed(make(), spent) if i < guided else None
        engine.submit(Request(prompt, greedy, constraint=constraint))
    engine.step()
    start = time.perf_counter()
    while engine.has_work:
        engine.step()
    seconds = time.perf_counter() - start
    done = engine.pop_finished()
    assert all(len(c.output_ids) == new_tokens for c in done), "a row stopped early"
    return len(prompts) * (new_tokens - 1) / seconds


def bench_structured(args) -> None:
    from axplug_structured import LLGuidanceGuide

    cfg = make_modifier("paged_kv_cache:page_size=16")(preset_config(args.preset).model)
    model = cfg.instantiate(parent=None)
    params = model.initialize_parameters_recursively(jax.random.PRNGKey(0))
    vocab = cfg.decoder.vocab_size
    guide = LLGuidanceGuide.default_config().instantiate()
    guide.bind(ByteTokenizer(), vocab)
    make = guide.compile("regex", f"[a-z ]{{{args.new_tokens}}}")
    prompts = np.random.default_rng(0).integers(0, vocab, (args.batch, 32)).tolist()
    engine = Engine(model, params, num_slots=args.batch, max_len=32 + args.new_tokens,
                    prefix_caching=False)  # fmt: skip
    settings = {"free": 0, "mixed": args.batch // 2, "constrained": args.batch}
    print(
        f"{args.preset} (random parameters, byte vocabulary {vocab}), paged cache, greedy, "
        f"batch {args.batch}, {args.new_tokens} new tokens, jax {jax.__version__} on "
        f"{jax.devices()[0].platform}; median [min-max] of {args.rounds} rounds"
    )
    tps: dict[str, list[float]] = {name: [] for name in settings}
    spent: list[float] = []
    for guided in settings.values():  # warm-up: compile every program
        _decode(engine, prompts, guided, args.new_tokens, make, [])
    for r in range(args.rounds):
        for name in settings if r % 2 == 0 else reversed(settings):
            tps[name].append(_decode(engine, prompts, settings[name], args.new_tokens, make,
                                     spent))  # fmt: skip
    free = statistics.median(tps["free"])
    print(f"{'batch':<14}{'constrained rows':>18}{'decode tok/s':>14}{'min-max':>14}{'x free':>9}")
    for name, guided in settings.items():
        median = statistics.median(tps[name])
        spread = f"{min(tps[name]):.0f}-{max(tps[name]):.0f}"
        print(f"{name:<14}{guided:>18}{median:>14.0f}{spread:>14}{median / free:>9.3f}")
    print(f"host mask time per constrained token (regex): {statistics.median(spent) * 1e6:.1f} us "
          f"median, p99 {np.percentile(spent, 99) * 1e6:.1f} us")  # fmt: skip
    walk = make_walk(guide, vocab)
    print(f"host mask time per token (the nested JSON schema, {walk[1]} tokens): "
          f"{walk[0] * 1e6:.1f} us median")  # fmt: skip


def make_walk(guide, vocab: int) -> tuple[float, int]:
    """(median seconds per mask, tokens) of the JSON schema's matcher along DOCUMENT."""
    constraint = guide.compile("json_schema", SCHEMA)()
    words = np.zeros((vocab + 31) // 32, np.int32)
    times = []
    text = json.dumps(DOCUMENT).encode()
    for token in text:
        start = time.perf_counter()
        constraint.fill(words)
        times.append(time.perf_counter() - start)
        assert (words[token // 32] >> (token % 32)) & 1, "the document must be allowed"
        constraint.accept(token)
    return statistics.median(times), len(text)


def add_parser(sub) -> None:
    p = sub.add_parser("structured", help="constrained rows: alone and in a mixed batch")
    p.add_argument("--preset", default="llama-tiny")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=5)
