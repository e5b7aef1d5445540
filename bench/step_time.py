"""Training-step time of an axplug preset against the same model and optimizer in plain JAX.

    python bench/step_time.py [--preset llama-tiny] [--rounds 5] [--steps-per-round 5] [--quick]

Both sides start from the same parameters (axplug's, copied into the plain layout) and must
agree on the first-step loss to 1e-5 relative, or the script exits 1 before timing. Steps are
timed in rounds where the sides take turns step by step (A B A B, then B A B A, ...), so load
from other processes hits both sides alike; compile time is measured on a fresh function each
time (re-jitting one hits JAX's cache). The last line is
`axplug/plain-jax step-time ratio: X.XXX`.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import tempfile
import time
from typing import Any

import jax
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import plain_llama  # noqa: E402

LOSS_RTOL = 1e-5


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="llama-tiny")
    p.add_argument("--rounds", type=int, default=None, help="alternating A/B rounds (5)")
    p.add_argument("--steps-per-round", type=int, default=None, help="steps per side (5)")
    p.add_argument("--compile-reps", type=int, default=None, help="fresh compiles per side (2)")
    p.add_argument("--quick", action="store_true", help="2 rounds x 3 steps, 1 compile rep")
    args = p.parse_args(argv)
    quick = dict(rounds=2, steps_per_round=3, compile_reps=1)
    full = dict(rounds=5, steps_per_round=5, compile_reps=2)
    for name, value in (quick if args.quick else full).items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    return args


class AxplugSide:
    """The framework's public path: preset config -> Trainer -> init_state / _train_step."""

    name = "axplug"

    def __init__(self, cfg: Any):
        self.cfg = cfg
        self.trainer = cfg.instantiate()
        self.state = None

    def fresh_jit(self):
        """A newly built jitted step (a new Trainer builds a new step function)."""
        return self.cfg.instantiate()._train_step

    def abstract_args(self, trainer=None) -> tuple:
        t = trainer or self.trainer
        icfg = self.cfg.input
        shape = (icfg.batch_size, icfg.seq_len)
        batch = jax.ShapeDtypeStruct(shape, np.int32, sharding=t.batch_sharding)
        return t.abstract_state, {"input_ids": batch, "target_labels": batch}

    def put(self, host_batch: dict) -> dict:
        return self.trainer.put_batch(host_batch)

    def step(self, batch: dict) -> Any:
        self.state, metrics = self.trainer._train_step(self.state, batch)
        return self.state, metrics

    @staticmethod
    def loss(out: Any) -> float:
        return float(out[1]["loss"])


class PlainSide:
    """bench/plain_llama.py: a params pytree, optax, one jax.jit with donation."""

    name = "plain-jax"

    def __init__(self, cfg: Any):
        self.spec = plain_llama.spec_from_config(cfg)
        self.tx = plain_llama.make_optimizer(cfg.learner, cfg.max_steps)
        self.batch_shape = (cfg.input.batch_size, cfg.input.seq_len)
        self.jitted = self.fresh_jit()
        self.params = self.opt_state = None

    def fresh_jit(self):
        return jax.jit(plain_llama.make_train_step(self.spec, self.tx), donate_argnums=(0, 1))

    def set_params(self, axplug_params: Any) -> None:
        # Copies: axplug donates its state, which would delete shared buffers.
        copied = jax.tree.map(lambda x: jax.device_put(np.array(x)), axplug_params)
        self.params = plain_llama.from_axplug_params(copied, self.spec)
        self.opt_state = jax.jit(self.tx.init)(self.params)

    def abstract_args(self, trainer=None) -> tuple:
        del trainer
        shape = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype)  # noqa: E731
        batch = jax.ShapeDtypeStruct(self.batch_shape, np.int32)
        params, opt_state = jax.tree.map(shape, (self.params, self.opt_state))
        return params, opt_state, {"input_ids": batch, "target_labels": batch}

    def put(self, host_batch: dict) -> dict:
        return {k: jax.device_put(np.asarray(v)) for k, v in host_batch.items()}

    def step(self, batch: dict) -> Any:
        self.params, self.opt_state, loss = self.jitted(self.params, self.opt_state, batch)
        return self.params, self.opt_state, loss

    @staticmethod
    def loss(out: Any) -> float:
        return float(out[2])


def time_compile(jitted, args: tuple) -> tuple[float, float, Any]:
    """(trace + lower seconds, XLA compile seconds, compiled)."""
    t0 = time.perf_counter()
    lowered = jitted.lower(*args)
    t1 = time.perf_counter()
    compiled = lowered.compile()
    return t1 - t0, time.perf_counter() - t1, compiled


def compiled_stats(compiled: Any) -> dict[str, float]:
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    mem = compiled.memory_analysis()
    return {
        "gflops": cost.get("flops", float("nan")) / 1e9,
        "gbytes_accessed": cost.get("bytes accessed", float("nan")) / 1e9,
        "temp_mb": getattr(mem, "temp_size_in_bytes", 0) / 2**20,
        "donated_mb": getattr(mem, "alias_size_in_bytes", 0) / 2**20,
        "hlo_lines": compiled.as_text().count("\n"),
    }


def fmt_ms(s: float) -> str:
    return f"{s * 1e3:8.1f} ms"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    jax.config.update("jax_enable_compilation_cache", False)  # compile times must be real
    from axplug.presets import preset_config

    out_dir = tempfile.mkdtemp(prefix="axplug-bench-")
    cfg = preset_config(
        args.preset,
        overrides=["compilation_cache_dir=None", "summary_writers=[]", f"output_dir={out_dir}"],
    )
    try:
        plain_llama.spec_from_config(cfg)
    except ValueError as e:
        print(f"preset {args.preset}: {e}", file=sys.stderr)
        return 2
    a, b = AxplugSide(cfg), PlainSide(cfg)
    tokens = cfg.input.batch_size * cfg.input.seq_len
    nparams = sum(x.size for x in jax.tree.leaves(a.trainer.abstract_state["params"]))
    print(
        f"preset {args.preset}: {nparams / 1e6:.2f}M params, {tokens} tokens/step, "
        f"{jax.device_count()} {jax.default_backend()} device(s), {os.cpu_count()} cores, "
        f"jax {jax.__version__}"
    )

    # Warm-up: compile the functions that will run (the call after .compile() reuses it).
    a.state = a.trainer.init_state()
    b.set_params(a.state["params"])
    cold = {}
    for side in (a, b):
        jitted = side.trainer._train_step if side is a else side.jitted
        cold[side.name] = time_compile(jitted, side.abstract_args())

    # Same math: identical first-step loss from identical parameters and batch.
    host = [cfg.input.instantiate().batch(i) for i in range(8)]
    batches = {s.name: [s.put(h) for h in host] for s in (a, b)}
    losses = {s.name: [s.loss(s.step(batches[s.name][i])) for i in range(3)] for s in (a, b)}
    rel = [abs(x - y) / abs(y) for x, y in zip(losses[a.name], losses[b.name], strict=True)]
    ok = rel[0] <= LOSS_RTOL
    print(
        f"loss check: step 1 axplug {losses[a.name][0]:.7f} plain-jax {losses[b.name][0]:.7f} "
        f"rel diff {rel[0]:.2e} (tolerance {LOSS_RTOL:.0e}): {'OK' if ok else 'MISMATCH'}; "
        f"steps 2-3 rel diff {rel[1]:.2e}, {rel[2]:.2e}"
    )
    if not ok:
        print("the two sides do not compute the same loss; not timing them", file=sys.stderr)
        return 1

    # Compile time of fresh functions, alternating sides.
    compiles: dict[str, list[tuple[float, float]]] = {a.name: [], b.name: []}
    for rep in range(args.compile_reps):
        for side in (a, b) if rep % 2 == 0 else (b, a):
            fresh = side.fresh_jit()
            trace, xla, _ = time_compile(fresh, side.abstract_args())
            compiles[side.name].append((trace, xla))

    # Step time: in each round the sides take turns step by step (A B A B..., then B A B A...),
    # so a burst of load from other processes lands on both; every step is blocked on.
    times: dict[str, list[float]] = {a.name: [], b.name: []}
    dispatch: dict[str, list[float]] = {a.name: [], b.name: []}
    round_medians: dict[str, list[float]] = {a.name: [], b.name: []}
    k = 3
    for side in (a, b):  # one untimed step each: the first after compiling runs slow
        jax.block_until_ready(side.step(batches[side.name][k % len(host)]))
    k += 1
    for r in range(args.rounds):
        gc.collect()
        these: dict[str, list[float]] = {a.name: [], b.name: []}
        for i in range(args.steps_per_round):
            for side in (a, b) if r % 2 == 0 else (b, a):
                batch = batches[side.name][(k + i) % len(host)]
                t0 = time.perf_counter()
                out = side.step(batch)
                t1 = time.perf_counter()
                jax.block_until_ready(out)
                these[side.name].append(time.perf_counter() - t0)
                dispatch[side.name].append(t1 - t0)
        for name, ts in these.items():
            times[name] += ts
            round_medians[name].append(statistics.median(ts))
        k += args.steps_per_round

    print(
        f"\n{args.rounds} rounds x {args.steps_per_round} steps per side, sides alternating "
        f"step by step (blocking on each step)"
    )
    print(f"{'':10} {'median':>11} {'min':>11} {'max':>11} {'tokens/s':>10} {'dispatch':>11}")
    med = {}
    for side in (a, b):
        ts = times[side.name]
        med[side.name] = statistics.median(ts)
        print(
            f"{side.name:10} {fmt_ms(med[side.name])}  {fmt_ms(min(ts))}  {fmt_ms(max(ts))} "
            f"{tokens / med[side.name]:10.0f}  {fmt_ms(statistics.median(dispatch[side.name]))}"
        )
    per_round = [x / y for x, y in zip(round_medians[a.name], round_medians[b.name], strict=True)]
    print(
        "per-round median ratios (axplug/plain-jax): "
        + " ".join(f"{x:.3f}" for x in per_round)
        + f"; ratio of fastest steps {min(times[a.name]) / min(times[b.name]):.3f}"
    )

    print("\ncompile (warm-up, then fresh functions): trace+lower / XLA compile")
    comp_total = {}
    for side in (a, b):
        trace, xla, _ = cold[side.name]
        reps = compiles[side.name]
        comp_total[side.name] = statistics.median(t + x for t, x in reps)
        rep_text = ", ".join(f"{t:.2f}+{x:.2f}" for t, x in reps)
        print(
            f"{side.name:10} warm-up {trace:.2f}+{xla:.2f} s; fresh {rep_text} s; "
            f"median total {comp_total[side.name]:.2f} s"
        )
    for side in (a, b):
        st = compiled_stats(cold[side.name][2])
        print(
            f"{side.name:10} XLA: {st['gflops']:.2f} GFLOP, {st['gbytes_accessed']:.3f} GB "
            f"accessed, temp {st['temp_mb']:.1f} MiB, donated {st['donated_mb']:.1f} MiB, "
            f"{st['hlo_lines']} HLO lines"
        )
    print(f"axplug/plain-jax compile-time ratio: {comp_total[a.name] / comp_total[b.name]:.3f}")
    print(f"axplug/plain-jax step-time ratio: {med[a.name] / med[b.name]:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
