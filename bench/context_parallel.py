"""Per-device temp memory of long-context training as the sequence grows, by strategy.

Each row is `axplug aot --preset llama-tiny --mesh-rule cpu --modifier mesh:seq=8` with one
sequence of N tokens and a context-parallel strategy (`--modifier context_parallel:strategy=S`,
axplug-context-parallel) or none (the core's sequence sharding, keys and values gathered by
XLA). The plan is compiled, never run: temp memory is XLA's `memory_analysis()`,
deterministic. The growth column is temp at N over temp at the smallest N; linear in the
sequence is N / N0 (8x from 32k to 256k).

    python bench/context_parallel.py                       # 32k, 64k, 128k, 256k tokens
    python bench/context_parallel.py --tokens 32768,65536 --strategies none,ring
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys


def plan(tokens: int, strategy: str) -> dict:
    cmd = [
        os.path.join(os.path.dirname(sys.executable), "axplug"), "aot", "--preset", "llama-tiny",
        "--mesh-rule", "cpu", "--modifier", "mesh:seq=8", "--set", f"input.seq_len={tokens}",
        "--set", "input.batch_size=1", "--json",
    ]  # fmt: skip
    if strategy != "none":
        cmd += ["--modifier", f"context_parallel:strategy={strategy}"]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if done.returncode not in (0, 3):  # 3: would not fit the device
        sys.exit(f"error: {' '.join(cmd)} failed:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", default="32768,65536,131072,262144")
    p.add_argument("--strategies", default="none,all_gather,all_to_all,ring")
    args = p.parse_args(argv)
    lengths = [int(t) for t in args.tokens.split(",")]
    print("| strategy | tokens | temp GiB/device | growth | x linear | collectives | compile s |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for strategy in args.strategies.split(","):
        first = None
        for tokens in lengths:
            r = plan(tokens, strategy)
            temp = r["memory"]["temp"]
            first = first or (tokens, temp)
            growth = temp / first[1]
            linear = growth / (tokens / first[0])
            ops = ", ".join(f"{k} {v}" for k, v in sorted(r["collectives"].items()))
            print(
                f"| {strategy} | {tokens} | {temp / 2**30:.4f} | {growth:.2f} | {linear:.2f} "
                f"| {ops} | {r['compile_s']:.1f} |",
                flush=True,
            )
        if (cp := r.get("context_parallel")) is not None:
            print(f"|  | {cp['description']} |  |  |  |  |  |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
