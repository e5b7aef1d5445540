"""Decoding speed of the serving stack: the Engine against a plain-JAX decoder, and the server.

    python bench/serve.py engine [--batch 8] [--prompt-len 64] [--new-tokens 128] [--rounds 5]
    python bench/serve.py http [--clients 8] [--requests 32] [--new-tokens 64]
    python bench/serve.py prefix [--prefix-len 1024] [--n 8]   (see bench/serve_prefix.py)
    python bench/serve.py speculative [--batch 1,8]        (see bench/serve_speculative.py)
    python bench/serve.py structured [--batch 8]           (see bench/serve_structured.py)
    python bench/serve.py lora [--batch 8] [--rank 16]     (see bench/serve_lora.py)
    python bench/serve.py quantized [--checkpoint RUN]     (see bench/serve_quantized.py)

`engine`: llama-tiny with random parameters, greedy; each round decodes `--batch` prompts
(and one alone) with `axplug.inference.Engine` (contiguous and paged caches, and paged with
`logprobs=5` on every token: the cost of log-probabilities) and with `bench/plain_decode.py`
(its cache token-major as the reference, and head-major: `plain-hm`, the stronger reference),
interleaved, after a warm-up round that compiles every shape. Time to first token is the
prefill call; decode tokens/s counts the later tokens over their time. Tokens must be equal
(checked). Prints medians with min-max and the Engine/plain ratios (decode tokens/s: higher is
better; TTFT: lower is better), and paged with logprobs over paged without.

`http`: starts `axplug serve` on a checkpoint (trains llama-tiny for 2 steps into a temporary
directory unless --checkpoint) and runs `--clients` concurrent streaming clients, `--rounds`
times per server; prints tokens/s, time to first token and inter-token latency p50/p99 as the
median over rounds with their min-max, for each server setting and with `logprobs: 5`.
"""

from __future__ import annotations

import argparse
import functools
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
from serve_lora import add_parser as add_lora_parser  # noqa: E402
from serve_lora import bench_lora  # noqa: E402
from serve_prefix import add_parser as add_prefix_parser  # noqa: E402
from serve_prefix import bench_prefix  # noqa: E402
from serve_quantized import add_parser as add_quantized_parser  # noqa: E402
from serve_quantized import bench_quantized  # noqa: E402
from serve_speculative import add_parser as add_speculative_parser  # noqa: E402
from serve_speculative import bench_speculative  # noqa: E402
from serve_structured import add_parser as add_structured_parser  # noqa: E402
from serve_structured import bench_structured  # noqa: E402


def engine_once(engine, prompts, new_tokens: int, logprobs=None):
    """(ids, prefill seconds, decode seconds) of `engine` serving `prompts` at once. The same
    engine serves every round: its programs are bound to it, so a new one compiles again."""
    sampling = SamplingParams(max_new_tokens=new_tokens, temperature=0, logprobs=logprobs)
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
    head_major = PlainDecoder(spec, plain.params, max_len, head_major=True)
    vocab = cfg.decoder.vocab_size
    prompts = np.random.default_rng(0).integers(0, vocab, (args.batch, args.prompt_len))
    print(
        f"{args.preset}: batch {args.batch}, prompt {args.prompt_len}, {args.new_tokens} new "
        f"tokens, greedy, jax {jax.__version__} on {jax.devices()[0].platform}"
    )

    results: dict[str, dict[str, list[float]]] = {}
    equal = total = 0
    for setting, batch in (("batch", prompts), ("alone", prompts[:1])):
        rows = batch.tolist()
        # No prefix caching: every round sends the same prompts, which would hit the cache
        # (`python bench/serve.py prefix` measures that); this measures prefill and decode.
        engines = {
            name: Engine(m, params, num_slots=len(rows), max_len=max_len, prefix_caching=False)
            for name, m in models.items()
        }
        runs = {
            name: functools.partial(engine_once, engine, rows, args.new_tokens)
            for name, engine in engines.items()
        }
        runs["paged+logprobs"] = functools.partial(
            engine_once, engines["paged"], rows, args.new_tokens, logprobs=5
        )
        runs["plain"] = lambda b=batch: plain.generate(jnp.asarray(b, jnp.int32), args.new_tokens)
        runs["plain-hm"] = lambda b=batch: head_major.generate(
            jnp.asarray(b, jnp.int32), args.new_tokens
        )
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
            for name in [*models, "paged+logprobs", "plain-hm"]:
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
    for setting in ("batch", "alone"):
        hm = statistics.median(results[f"plain-hm {setting}"]["tps"])
        for name in models:
            ratio = statistics.median(results[f"{name} {setting}"]["tps"]) / hm
            print(f"{name} {setting}: decode tok/s x{ratio:.3f} of the head-major plain decoder")
    for setting in ("batch", "alone"):
        with_lp, without = results[f"paged+logprobs {setting}"], results[f"paged {setting}"]
        ratio = statistics.median(with_lp["tps"]) / statistics.median(without["tps"])
        ttft = statistics.median(with_lp["ttft"]) / statistics.median(without["ttft"])
        print(f"logprobs=5 cost, {setting}: decode tok/s x{ratio:.3f}, TTFT x{ttft:.3f}")
    print(f"tokens equal to the plain decoder: {equal}/{total}")


def _percentile(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


async def _client(
    http, base: str, prompts: list[list[int]], new_tokens: int, out: list, logprobs=None
) -> None:
    """Streams each prompt in turn; records (ttft, [inter-token gaps], tokens)."""
    import json

    for prompt in prompts:
        body = {"model": "bench", "prompt": prompt, "max_tokens": new_tokens, "temperature": 0,
                "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
        if logprobs is not None:
            body["logprobs"] = logprobs
        start = last = time.perf_counter()
        first, gaps, tokens = None, [], 0
        async with http.stream("POST", base + "/v1/completions", json=body) as response:
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                now = time.perf_counter()
                if chunk.get("usage"):
                    tokens = chunk["usage"]["completion_tokens"]
                elif chunk["choices"] and chunk["choices"][0]["text"]:
                    if first is None:
                        first = now - start
                    else:
                        gaps.append(now - last)
                    last = now
        out.append((first or 0.0, gaps, tokens))


def _serve_load(args, extra: list[str], checkpoint: str, logprobs_too: bool) -> dict:
    """Per load (plain, and with logprobs if `logprobs_too`): one summary dict per round."""
    import asyncio
    import os
    import socket
    import subprocess

    import httpx

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2")
    cmd = [sys.executable, "-m", "axplug.cli", "serve", "--checkpoint", checkpoint,
           "--port", str(port), "--model-name", "bench", "--num-slots", str(args.clients),
           "--max-len", str(args.max_len), "--log-level", "warning", *extra]  # fmt: skip
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    base = f"http://127.0.0.1:{port}"
    try:
        for _ in range(600):
            try:
                if httpx.get(base + "/health").status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.5)
        else:
            raise RuntimeError(f"the server did not start: {proc.stderr.read()}")
        rng = np.random.default_rng(0)
        # Every 4th prompt is long: it arrives while the others decode.
        prompts = [rng.integers(0, 256, args.long_prompt if i % 4 == 3 else args.prompt_len)
                   .tolist() for i in range(args.requests)]  # fmt: skip
        per_client = [prompts[i :: args.clients] for i in range(args.clients)]

        async def load(logprobs):
            results: list = []
            async with httpx.AsyncClient(timeout=600) as http:
                await _client(http, base, prompts[:2], 4, [], logprobs)  # warm the path
                start = time.perf_counter()
                await asyncio.gather(*(_client(http, base, p, args.new_tokens, results,
                                               logprobs) for p in per_client))  # fmt: skip
                return results, time.perf_counter() - start

        loads = {"": None, " +logprobs=5": 5} if logprobs_too else {"": None}
        rounds: dict[str, list[dict]] = {suffix: [] for suffix in loads}
        for _ in range(args.rounds):  # the loads interleaved, round by round
            for suffix, logprobs in loads.items():
                results, seconds = asyncio.run(load(logprobs))
                ttft = [r[0] for r in results]
                gaps = [g for r in results for g in r[1]]
                rounds[suffix].append({
                    "tok/s": sum(r[2] for r in results) / seconds,
                    "ttft p50": _percentile(ttft, 50), "ttft p99": _percentile(ttft, 99),
                    "itl p50": _percentile(gaps, 50), "itl p99": _percentile(gaps, 99),
                })  # fmt: skip
    finally:
        proc.terminate()
        proc.wait(60)
    return rounds


def bench_http(args) -> None:
    import tempfile

    checkpoint = args.checkpoint
    if checkpoint is None:
        from axplug.trainer.run import train

        checkpoint = tempfile.mkdtemp(prefix="axplug-serve-bench-")
        cfg = preset_config(args.preset).clone(
            output_dir=checkpoint, max_steps=2, checkpoint_every=2, compilation_cache_dir=None
        )
        cfg.summary_writers = []
        train(cfg)
    configs = [
        ("unified, chunked prefill (64)", ["--prefill-chunk", "64"]),
        ("unified, whole prompts", ["--prefill-chunk", "0"]),
        ("disaggregated 1+1 devices", ["--prefill-chunk", "64", "--prefill-devices", "1"]),
    ]
    print(
        f"{args.preset} over HTTP: {args.clients} streaming clients, {args.requests} requests, "
        f"prompts of {args.prompt_len} tokens (every 4th {args.long_prompt}), "
        f"{args.new_tokens} new tokens, greedy; 2 CPU devices; median [min-max] of "
        f"{args.rounds} rounds"
    )
    columns = ("tok/s", "ttft p50", "ttft p99", "itl p50", "itl p99")
    print(f"{'server':<44}" + "".join(f"{c:>22}" for c in columns) + "  (times in ms)")
    base_tps = {}
    for i, (name, extra) in enumerate(configs):
        for suffix, rounds in _serve_load(args, extra, checkpoint, logprobs_too=i == 0).items():
            cells = []
            for column in columns:
                scale = 1 if column == "tok/s" else 1e3
                values = [r[column] * scale for r in rounds]
                cells.append(f"{statistics.median(values):.1f} [{min(values):.1f}-"
                             f"{max(values):.1f}]")  # fmt: skip
            print(f"{name + suffix:<44}" + "".join(f"{c:>22}" for c in cells))
            base_tps[suffix] = base_tps.get(suffix) or statistics.median(r["tok/s"] for r in rounds)
    if len(base_tps) == 2:
        ratio = base_tps[" +logprobs=5"] / base_tps[""]
        print(f"logprobs=5 over HTTP (first setting): tokens/s x{ratio:.3f}")


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
    http = sub.add_parser("http", help="concurrent streaming clients against axplug serve")
    http.add_argument("--preset", default="llama-tiny")
    http.add_argument("--checkpoint", help="a run directory (default: train one for 2 steps)")
    http.add_argument("--clients", type=int, default=8)
    http.add_argument("--requests", type=int, default=32)
    http.add_argument("--prompt-len", type=int, default=32)
    http.add_argument("--long-prompt", type=int, default=192)
    http.add_argument("--new-tokens", type=int, default=64)
    http.add_argument("--max-len", type=int, default=256)
    http.add_argument("--rounds", type=int, default=3)
    add_prefix_parser(sub)
    add_speculative_parser(sub)
    add_structured_parser(sub)
    add_lora_parser(sub)
    add_quantized_parser(sub)
    args = parser.parse_args()
    run = {"engine": bench_engine, "http": bench_http, "prefix": bench_prefix}
    run["speculative"] = bench_speculative
    run["structured"] = bench_structured
    run["lora"] = bench_lora
    run["quantized"] = bench_quantized
    run[args.what](args)


if __name__ == "__main__":
    main()
