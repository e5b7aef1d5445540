"""int8 and fp8 training matmuls against bf16: time of forward + backward, and what XLA
compiled them to (the GEMM custom calls on a GPU, the dot element types on CPU).

    python bench/quantized_matmul.py [--tokens 8192 --dim 4096 --hidden 4096 --reps 20]
"""

from __future__ import annotations

import argparse
import re
import statistics
import time
from collections import Counter


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--dim", type=int, default=4096)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args(argv)

    import jax
    import jax.numpy as jnp
    from axplug_quantize import fp8_matmul, int8_matmul

    kx, kw, kd = jax.random.split(jax.random.PRNGKey(0), 3)
    x = jax.random.normal(kx, (args.tokens, args.dim), jnp.bfloat16)
    w = (jax.random.normal(kw, (args.dim, args.hidden), jnp.float32) * 0.02).astype(jnp.bfloat16)
    dy = jax.random.normal(kd, (args.tokens, args.hidden), jnp.bfloat16)
    h = jnp.zeros(16, jnp.float32).at[0].set(4.0)
    hw = jnp.zeros(16, jnp.float32).at[0].set(0.1)

    def fwd_bwd(matmul):
        def f(x, w, dy):
            y, vjp = jax.vjp(matmul, x, w)
            return (y, *vjp(dy))

        return jax.jit(f)

    sides = {
        "bf16": fwd_bwd(lambda x, w: x @ w),
        "int8": fwd_bwd(lambda x, w: int8_matmul(x, w, True).astype(jnp.bfloat16)),
        "int8-fwd": fwd_bwd(lambda x, w: int8_matmul(x, w, False).astype(jnp.bfloat16)),
        "fp8": fwd_bwd(lambda x, w: fp8_matmul(x, w, h, hw, h)),
    }
    compiled = {k: f.lower(x, w, dy).compile() for k, f in sides.items()}
    ref = compiled["bf16"](x, w, dy)
    times = {k: [] for k in sides}
    for _ in range(args.rounds):
        for k, c in compiled.items():
            jax.block_until_ready(c(x, w, dy))
            t0 = time.perf_counter()
            for _ in range(args.reps):
                out = c(x, w, dy)
            jax.block_until_ready(out)
            times[k].append((time.perf_counter() - t0) / args.reps)
    flops = 3 * 2 * args.tokens * args.dim * args.hidden
    base = statistics.median(times["bf16"])
    print(
        f"{jax.devices()[0].device_kind}, jax {jax.__version__}: [{args.tokens}x{args.dim}] @ "
        f"[{args.dim}x{args.hidden}], forward + both gradients, {args.rounds} rounds x {args.reps}"
    )
    print("| matmul | ms median [min-max] | TFLOP/s | x bf16 time | max rel err of y | GEMMs |")
    print("| --- | --- | --- | --- | --- | --- |")
    for k, c in compiled.items():
        med = statistics.median(times[k])
        y = c(x, w, dy)[0].astype(jnp.float32)
        err = float(
            jnp.max(jnp.abs(y - ref[0].astype(jnp.float32)))
            / jnp.max(jnp.abs(ref[0].astype(jnp.float32)))
        )
        spread = f"{min(times[k]) * 1e3:.3f}-{max(times[k]) * 1e3:.3f}"
        print(
            f"| {k} | {med * 1e3:.3f} [{spread}] | {flops / med / 1e12:.1f} | {med / base:.2f} "
            f"| {err:.2e} | {gemm_census(c.as_text())} |"
        )


def gemm_census(hlo: str) -> str:
    """GEMM custom calls (GPU) with their operand element types, else dot result types."""
    calls = Counter()
    types = dict(re.findall(r"%([\w.\-]+) = (\w+)\[", hlo))
    for line in hlo.splitlines():
        m = re.search(
            r'custom-call\(([^)]*)\).*custom_call_target="(__cublas[^"]*|__cudnn[^"]*)"', line
        )
        if m:
            ops = [types.get(o.strip().lstrip("%"), "?") for o in m.group(1).split(",")[:2]]
            calls[f"{m.group(2)}({'x'.join(ops)})"] += 1
            continue
        m = re.search(r"= (\w+)\[[^\]]*\]\S* dot\(%([\w.\-]+), %([\w.\-]+)\)", line)
        if m:
            calls[
                f"dot {types.get(m.group(2), '?')}x{types.get(m.group(3), '?')}->{m.group(1)}"
            ] += 1
    return ", ".join(f"{k} x{n}" for k, n in sorted(calls.items()))


if __name__ == "__main__":
    main()
