"""Decoding speed of the serving stack: the Engine against a plain-JAX decoder, and the server.

    python bench/serve.py engine [--batch 8] [--prompt-len 64] [--new-tokens 128] [--rounds 5]
    python bench/serve.py http [--clients 8] [--requests 32] [--new-tokens 64]

`engine`: llama-tiny with random parameters, greedy; each round decodes `--batch` prompts
(and one alone) with `axplug.inference.Engine` (contiguous and paged caches) and with
`bench/plain_decode.py`, interleaved, after a warm-up round that compiles every shape.
Time to first token is the prefill call; decode tokens/s counts the later tokens over their
time. Tokens must be equal (checked). Prints medians and the Engine/plain ratios
(decode tokens/s: higher is better; TTFT: lower is better).

`http`: starts `axplug serve` on a checkpoint (trains llama-tiny for 2 steps into a temporary
directory unless --checkpoint) and runs `--clients` concurrent streaming clients; prints
tokens/s, time to first token and inter-token latency p50/p99.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from axplug.inference import Engine, Request, SamplingParams
from axplug.modifiers import make_modifier
from axplug.presets import preset_config

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from plain_decode import PlainDecoder  # noqa: E402
from plain_llama import from_axplug_params, spec_from_config  # noqa: E402


def engine_once(model, params, prompts, new_tokens: int, max_len: int):
    """(ids, prefill seconds, decode seconds) of the Engine serving `prompts` at once."""
    engine = Engine(model, params, num_slots=len(prompts), max_len=max_len)
    sampling = SamplingParams(max_new_tokens=new_tokens, temperature=0)
    ids = [engine.submit(Request(p, sampling)) for p in prompts]
    start = time.perf_counter()
    engine.step()  # admits and prefills every request: each gets its first token
    prefill = time.perf_counter() - start
    start = time.perf_counter()
    while engine.has_work:
        engine.step()
    decode = time.perf_counter() - start
    done = {c.id: c.output_ids for c in engine.pop_finished()}
    return [done[i] for i in ids], prefill, decode


def bench_engine(args) -> None:
    trainer_cfg = preset_config(args.preset)
    cfg = trainer_cfg.model
    spec = spec_from_config(trainer_cfg)
    models = {"contiguous": cfg.instantiate(parent=None)}
    paged = make_modifier(f"paged_kv_cache:page_size={args.page_size}")(cfg.clone())
    models["paged"] = paged.instantiate(parent=None)
    params = models["contiguous"].initialize_parameters_recursively(jax.random.PRNGKey(0))
    max_len = args.prompt_len + args.new_tokens
    plain = PlainDecoder(spec, from_axplug_params(params, spec), max_len)
    vocab = cfg.decoder.vocab_size
    prompts = np.random.default_rng(0).integers(0, vocab, (args.batch, args.prompt_len))
    print(
        f"{args.preset}: batch {args.batch}, prompt {args.prompt_len}, {args.new_tokens} new "
        f"tokens, greedy, jax {jax.__version__} on {jax.devices()[0].platform}"
    )

    results: dict[str, dict[str, list[float]]] = {}
    equal = total = 0
    for setting, batch in (("batch", prompts), ("alone", prompts[:1])):
        runs = {name: (lambda m=m, b=batch: engine_once(m, params, b.tolist(), args.new_tokens, max_len))
                for name, m in models.items()}  # fmt: skip
        runs["plain"] = lambda b=batch: plain.generate(jnp.asarray(b, jnp.int32), args.new_tokens)
        for run in runs.values():  # warm-up: compile every shape
            run()
        for r in range(args.rounds):
            order = list(runs) if r % 2 == 0 else list(reversed(runs))
            outs = {}
            for name in order:
                ids, prefill, decode = runs[name]()
                outs[name] = ids
                row = results.setdefault(f"{name} {setting}", {"ttft": [], "tps": []})
                row["ttft"].append(prefill)
                row["tps"].append(len(batch) * (args.new_tokens - 1) / decode)
            for name in models:
                for a, b in zip(outs[name], outs["plain"], strict=True):
                    equal += sum(int(x == y) for x, y in zip(a, b, strict=True))
                    total += len(b)

    print(f"{'decoder':<20}{'TTFT ms':>10}{'decode tok/s':>14}{'min-max':>14}"
          f"{'TTFT x plain':>14}{'tok/s x plain':>15}")  # fmt: skip
    for name, row in results.items():
        setting = name.split()[1]
        base = results[f"plain {setting}"]
        ttft, tps = statistics.median(row["ttft"]), statistics.median(row["tps"])
        spread = f"{min(row['tps']):.0f}-{max(row['tps']):.0f}"
        print(
            f"{name:<20}{ttft * 1e3:>10.2f}{tps:>14.0f}{spread:>14}"
            f"{ttft / statistics.median(base['ttft']):>14.3f}"
            f"{tps / statistics.median(base['tps']):>15.3f}"
        )
    print(f"tokens equal to the plain decoder: {equal}/{total}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="what", required=True)
    eng = sub.add_parser("engine", help="the Engine against a plain-JAX decoder")
    eng.add_argument("--preset", default="llama-tiny")
    eng.add_argument("--batch", type=int, default=8)
    eng.add_argument("--prompt-len", type=int, default=64)
    eng.add_argument("--new-tokens", type=int, default=128)
    eng.add_argument("--rounds", type=int, default=5)
    eng.add_argument("--page-size", type=int, default=16)
    args = parser.parse_args()
    if args.what == "engine":
        bench_engine(args)


if __name__ == "__main__":
    main()
