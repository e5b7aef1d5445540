"""Decode throughput and time to first token of `llama-tiny`, contiguous vs paged KV cache.

    python bench/decode.py [--batch 8] [--prompt-len 64] [--new-tokens 128] [--rounds 3]
                           [--page-size 16] [--preset llama-tiny]

Random parameters (throughput does not depend on training). Each round serves `--batch`
requests of `--prompt-len` tokens through `axplug.inference.Engine` with `--batch` slots,
once per cache kind, alternating the order, after one warm-up round that compiles every shape.
Time to first token is the prefill call (all prompts in one call); decode tokens/s counts the
tokens of the later steps over their time. Also reports one request alone (batch 1). The last
line is `paged/contiguous decode tokens/s ratio: X.XXX`.
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import numpy as np

from axplug.inference import Engine, Request, SamplingParams
from axplug.modifiers import make_modifier
from axplug.presets import preset_config


def build(preset: str, cache_modifier: str | None):
    cfg = preset_config(preset).model
    if cache_modifier:
        cfg = make_modifier(cache_modifier)(cfg)
    model = cfg.instantiate(parent=None)
    return model


def serve_once(engine, prompts, new_tokens: int) -> tuple[float, float, int]:
    """(prefill seconds, decode seconds, decoded tokens) for one batch of requests. The same
    engine serves every round: its programs are bound to it, so a new one compiles again."""
    sampling = SamplingParams(max_new_tokens=new_tokens, temperature=0.8, seed=0)
    for prompt in prompts:
        engine.submit(Request(prompt, sampling))
    start = time.perf_counter()
    engine.step()  # admits and prefills every request: each gets its first token
    prefill = time.perf_counter() - start
    tokens = 0
    start = time.perf_counter()
    while engine.has_work:
        tokens += len(engine.step())
    decode = time.perf_counter() - start
    return prefill, decode, tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", default="llama-tiny")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--page-size", type=int, default=16)
    args = parser.parse_args()

    kinds = {"contiguous": None, "paged": f"paged_kv_cache:page_size={args.page_size}"}
    models = {kind: build(args.preset, mod) for kind, mod in kinds.items()}
    params = models["contiguous"].initialize_parameters_recursively(jax.random.PRNGKey(0))
    rng = np.random.default_rng(0)
    vocab = models["contiguous"].config.decoder.vocab_size
    prompts = rng.integers(0, vocab, (args.batch, args.prompt_len)).tolist()
    max_len = args.prompt_len + args.new_tokens
    print(
        f"{args.preset}: batch {args.batch}, prompt {args.prompt_len}, {args.new_tokens} new "
        f"tokens, jax {jax.__version__} on {jax.devices()[0].platform}"
    )

    results: dict[str, dict[str, list[float]]] = {}
    for setting, batch in (("batch", prompts), ("alone", prompts[:1])):
        engines = {
            kind: Engine(model, params, num_slots=len(batch), max_len=max_len)
            for kind, model in models.items()
        }
        for engine in engines.values():  # warm-up: compile every shape
            serve_once(engine, batch, args.new_tokens)
        for r in range(args.rounds):
            order = list(models) if r % 2 == 0 else list(reversed(models))
            for kind in order:
                prefill, decode, tokens = serve_once(engines[kind], batch, args.new_tokens)
                row = results.setdefault(f"{kind} {setting}", {"ttft": [], "tps": []})
                row["ttft"].append(prefill)
                row["tps"].append(tokens / decode)

    print(f"{'cache':<20}{'TTFT ms (median)':>18}{'decode tok/s (median)':>24}{'min-max':>20}")
    for name, row in results.items():
        tps = row["tps"]
        print(
            f"{name:<20}{statistics.median(row['ttft']) * 1e3:>18.1f}"
            f"{statistics.median(tps):>24.1f}{f'{min(tps):.0f}-{max(tps):.0f}':>20}"
        )
    ratio = statistics.median(results["paged batch"]["tps"]) / statistics.median(
        results["contiguous batch"]["tps"]
    )
    print(f"paged/contiguous decode tokens/s ratio: {ratio:.3f}")


if __name__ == "__main__":
    main()
