"""Training-step time of axplug against the same model in plain JAX and in Flax NNX.

    python bench/step_time.py [--shapes llama-tiny,small,moe-tiny] [--rounds R]
                              [--steps-per-round S] [--compile-reps C] [--no-flax] [--quick]

Shapes: `llama-tiny`, `small` (llama-tiny at d_model 512, 8 layers, seq 512), `moe-tiny`
(llama-tiny with 8 experts top-2), or any preset plain_llama.py implements. For each shape
all sides start from the same parameters (axplug's, copied into the other layouts) and must
agree on the first-step loss to 1e-5 relative, or the script exits 1 before timing. Steps
are timed in rounds where the sides take turns step by step (A B C, then B C A, ...), so
load from other processes hits every side alike; compile time is measured on fresh
functions. MFU is against an f32 matmul peak measured in the same run. The last line is
`axplug/plain-jax step-time ratio: X.XXX` for the first shape.
"""

from __future__ import annotations

import argparse
import atexit
import collections
import dataclasses
import gc
import os
import re
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any

import jax
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import matmul_peak  # noqa: E402
import plain_llama  # noqa: E402

__all__ = ["SHAPES", "Shape", "shape_config", "make_sides", "check_losses", "run_shape", "main"]

LOSS_RTOL = {"float32": 1e-5, "bfloat16": 2e-2}


@dataclasses.dataclass(frozen=True)
class Shape:
    """A preset plus overrides, and its default (rounds, steps per round, compile reps)."""

    preset: str
    overrides: tuple[str, ...] = ()
    full: tuple[int, int, int] = (5, 3, 2)
    quick: tuple[int, int, int] = (2, 3, 1)


SHAPES = {
    "llama-tiny": Shape("llama-tiny"),
    "small": Shape(
        "llama-tiny",
        (
            "model.decoder.dim=512",
            "model.decoder.transformer.num_layers=8",
            "model.decoder.transformer.layer.feed_forward.hidden_dim=1408",
            "input.seq_len=512",
        ),
        full=(3, 1, 2),
        quick=(1, 1, 0),
    ),
    "moe-tiny": Shape("moe-tiny", full=(4, 2, 1), quick=(2, 1, 0)),
}


def shape_config(
    name: str, extra_overrides: tuple[str, ...] = (), modifiers: tuple[str, ...] = ()
) -> Any:
    """The Trainer config of shape `name` (or of the preset `name`) for benchmarking."""
    from axplug.presets import preset_config

    shape = SHAPES.get(name, Shape(name))
    out_dir = tempfile.mkdtemp(prefix="axplug-bench-")
    atexit.register(shutil.rmtree, out_dir, ignore_errors=True)
    return preset_config(
        shape.preset,
        modifiers=modifiers,
        overrides=[
            "compilation_cache_dir=None",
            "summary_writers=[]",
            f"output_dir={out_dir!r}",
            *shape.overrides,
            *extra_overrides,
        ],
    )


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--shapes",
        default=None,
        help="comma-separated (llama-tiny,small,moe-tiny; --quick: llama-tiny)",
    )
    p.add_argument("--preset", default=None, help="one shape or preset (same as --shapes X)")
    p.add_argument("--rounds", type=int, default=None, help="alternating rounds")
    p.add_argument("--steps-per-round", type=int, default=None, help="steps per side a round")
    p.add_argument("--compile-reps", type=int, default=None, help="fresh compiles per side")
    p.add_argument("--no-flax", action="store_true", help="axplug and plain JAX only")
    p.add_argument("--quick", action="store_true", help="llama-tiny, 2 rounds x 3 steps")
    args = p.parse_args(argv)
    if args.preset:
        args.shapes = args.preset
    elif args.shapes is None:
        args.shapes = "llama-tiny" if args.quick else ",".join(SHAPES)
    args.shapes = [s for s in args.shapes.split(",") if s]
    return args


# --- the three sides --------------------------------------------------------------------------


class AxplugSide:
    """The framework's public path: preset config -> Trainer -> init_state / _train_step."""

    name = "axplug"

    def __init__(self, cfg: Any):
        self.cfg = cfg
        self.trainer = cfg.instantiate()
        self.state = None
        self.jitted = self.trainer._train_step

    def fresh_jit(self):
        """A newly built jitted step (a new Trainer builds a new step function)."""
        return self.cfg.instantiate()._train_step

    def init(self) -> Any:
        self.state = self.trainer.init_state()
        return self.state["params"]

    def abstract_args(self) -> tuple:
        icfg = self.cfg.input
        batch = jax.ShapeDtypeStruct(
            (icfg.batch_size, icfg.seq_len), np.int32, sharding=self.trainer.batch_sharding
        )
        return self.trainer.layout.abstract, {"input_ids": batch, "target_labels": batch}

    def put(self, host_batch: dict) -> dict:
        return self.trainer.put_batch(host_batch)

    def step(self, batch: dict) -> Any:
        self.state, metrics = self.jitted(self.state, batch)
        return self.state, metrics

    @staticmethod
    def loss(out: Any) -> float:
        return float(out[1]["loss"])


def _copy(tree: Any) -> Any:
    # Copies: every side donates its state, which would delete shared buffers.
    return jax.tree.map(lambda x: jax.device_put(np.array(x)), tree)


def _abstract(tree: Any) -> Any:
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tree)


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

    def layout(self, axplug_params: Any) -> Any:
        return plain_llama.from_axplug_params(_copy(axplug_params), self.spec)

    def set_params(self, axplug_params: Any) -> None:
        self.params = self.layout(axplug_params)
        self.opt_state = jax.jit(self.tx.init)(self.params)

    def abstract_args(self) -> tuple:
        batch = jax.ShapeDtypeStruct(self.batch_shape, np.int32)
        params, opt_state = _abstract((self.params, self.opt_state))
        return params, opt_state, {"input_ids": batch, "target_labels": batch}

    def put(self, host_batch: dict) -> dict:
        return {k: jax.device_put(np.asarray(v)) for k, v in host_batch.items()}

    def step(self, batch: dict) -> Any:
        self.params, self.opt_state, loss = self.jitted(self.params, self.opt_state, batch)
        return self.params, self.opt_state, loss

    @staticmethod
    def loss(out: Any) -> float:
        return float(out[2])


class FlaxSide(PlainSide):
    """bench/flax_llama.py: NNX modules, split once, merged inside one jax.jit with donation."""

    name = "flax-nnx"

    def __init__(self, cfg: Any):
        import flax_llama

        self._flax = flax_llama
        spec = plain_llama.spec_from_config(cfg)
        self.graphdef, _ = flax_llama.abstract_split(spec)
        super().__init__(cfg)

    def fresh_jit(self):
        step = self._flax.make_train_step(self.graphdef, self.tx)
        return jax.jit(step, donate_argnums=(0, 1))

    def layout(self, axplug_params: Any) -> Any:
        from flax import nnx

        plain = super().layout(axplug_params)
        _, state = self._flax.abstract_split(self.spec)
        nnx.replace_by_pure_dict(state, self._flax.from_plain_params(plain, self.spec))
        return state


def make_sides(cfg: Any, flax: bool = True) -> list:
    """[axplug, plain-jax, flax-nnx]: every side's step built, parameters not yet set."""
    sides = [AxplugSide(cfg), PlainSide(cfg)]
    if flax:
        sides.append(FlaxSide(cfg))
    return sides


def check_losses(sides: list, batches: dict, steps: int, rtol: float) -> tuple[bool, str]:
    """Runs `steps` steps per side; (first-step losses all within rtol of plain-jax, report)."""
    losses = {s.name: [s.loss(s.step(batches[s.name][i])) for i in range(steps)] for s in sides}
    ref = losses["plain-jax"]
    parts, ok = [], True
    for name, ls in losses.items():
        if name == "plain-jax":
            continue
        rel = [abs(x - y) / abs(y) for x, y in zip(ls, ref, strict=True)]
        ok &= rel[0] <= rtol
        later = ", ".join(f"{r:.1e}" for r in rel[1:])
        parts.append(f"{name} {ls[0]:.7f} (rel {rel[0]:.1e}{'; later ' + later if later else ''})")
    text = (
        f"loss check, step 1: plain-jax {ref[0]:.7f}; " + "; ".join(parts) + f"; tolerance "
        f"{rtol:.0e}: {'OK' if ok else 'MISMATCH'}"
    )
    return ok, text


# --- measuring ----------------------------------------------------------------------------------


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


def opcode_counts(hlo_text: str) -> collections.Counter:
    """How many instructions of each HLO opcode a compiled module's text holds."""
    return collections.Counter(re.findall(r"= \S+ ([a-z][a-z0-9-]*)\(", hlo_text))


def fmt_ms(s: float) -> str:
    return f"{s * 1e3:9.1f} ms"


def run_shape(
    name: str,
    cfg: Any,
    *,
    rounds: int,
    steps_per_round: int,
    compile_reps: int,
    peak: Any,
    peak_label: str,
    flax: bool = True,
    loss_steps: int = 2,
) -> dict[str, Any] | None:
    """Times one shape on every side and prints its tables; None if the losses disagree.

    `peak` is a FLOP/s figure, or an object whose `sample()` measures one now (then it is
    sampled once per round, between the steps, and MFU uses the median sample).
    """
    sides = make_sides(cfg, flax)
    a = sides[0]
    tokens = cfg.input.batch_size * cfg.input.seq_len
    nparams = sum(x.size for x in jax.tree.leaves(a.trainer.layout.abstract["params"]))
    print(
        f"\n=== {name}: {nparams / 1e6:.2f}M params, {tokens} tokens/step, "
        f"compute {plain_llama.spec_from_config(cfg).compute_dtype} ==="
    )

    # Warm-up: compile the functions that will run (the call after .compile() reuses it).
    params = a.init()
    for side in sides[1:]:
        side.set_params(params)
    cold = {s.name: time_compile(s.jitted, s.abstract_args()) for s in sides}

    # Equal work: identical first-step loss from identical parameters and batches. These
    # steps are also the untimed warm-up steps (the first step after compiling runs slow).
    host = [cfg.input.instantiate().batch(i) for i in range(8)]
    batches = {s.name: [s.put(h) for h in host] for s in sides}
    rtol = LOSS_RTOL.get(plain_llama.spec_from_config(cfg).compute_dtype, 1e-5)
    ok, text = check_losses(sides, batches, max(loss_steps, 2), rtol)
    print(text)
    if not ok:
        print(f"{name}: the sides do not compute the same loss; not timing them", file=sys.stderr)
        return None

    # Compile time of fresh functions, the order rotating.
    compiles: dict[str, list[tuple[float, float]]] = {s.name: [] for s in sides}
    for rep in range(compile_reps):
        for side in sides[rep % len(sides) :] + sides[: rep % len(sides)]:
            trace, xla, _ = time_compile(side.fresh_jit(), side.abstract_args())
            compiles[side.name].append((trace, xla))
            gc.collect()

    # Step time: in each round the sides take turns step by step, the order rotating by
    # round, so a burst of load from other processes lands on all; every step is blocked on.
    times: dict[str, list[float]] = {s.name: [] for s in sides}
    dispatch: dict[str, list[float]] = {s.name: [] for s in sides}
    round_medians: dict[str, list[float]] = {s.name: [] for s in sides}
    k = max(loss_steps, 2)
    peaks = [] if hasattr(peak, "sample") else [float(peak)]
    for r in range(rounds):
        gc.collect()
        order = sides[r % len(sides) :] + sides[: r % len(sides)]
        these: dict[str, list[float]] = {s.name: [] for s in sides}
        for i in range(steps_per_round):
            for side in order:
                batch = batches[side.name][(k + i) % len(host)]
                t0 = time.perf_counter()
                out = side.step(batch)
                t1 = time.perf_counter()
                jax.block_until_ready(out)
                these[side.name].append(time.perf_counter() - t0)
                dispatch[side.name].append(t1 - t0)
        if hasattr(peak, "sample"):
            peaks.append(peak.sample())
        for n, ts in these.items():
            times[n] += ts
            round_medians[n].append(statistics.median(ts))
        k += steps_per_round

    stats = {s.name: compiled_stats(cold[s.name][2]) for s in sides}
    model_flops = stats["plain-jax"]["gflops"] * 1e9  # the work all sides do
    peak_flops = statistics.median(peaks)
    print(
        f"{rounds} rounds x {steps_per_round} steps per side, sides alternating step by step; "
        f"MFU = plain-jax XLA FLOPs / step time / {peak_label} "
        f"{peak_flops / 1e9:.1f} GFLOP/s"
        + (
            f" (median of rounds, {min(peaks) / 1e9:.1f}-{max(peaks) / 1e9:.1f})"
            if len(peaks) > 1
            else ""
        )
    )
    print(
        f"{'':10} {'median':>12} {'min':>12} {'max':>12} {'tokens/s':>9} {'MFU':>6} "
        f"{'dispatch':>12}"
    )
    med = {}
    for side in sides:
        ts = times[side.name]
        med[side.name] = statistics.median(ts)
        print(
            f"{side.name:10} {fmt_ms(med[side.name])} {fmt_ms(min(ts))} {fmt_ms(max(ts))} "
            f"{tokens / med[side.name]:9.0f} {model_flops / med[side.name] / peak_flops:6.1%} "
            f"{fmt_ms(statistics.median(dispatch[side.name]))}"
        )

    print("compile: trace+lower / XLA compile seconds (warm-up; fresh functions)")
    comp_total = {}
    for side in sides:
        trace, xla, _ = cold[side.name]
        reps = compiles[side.name] or [(trace, xla)]
        comp_total[side.name] = statistics.median(t + x for t, x in reps)
        rep_text = ", ".join(f"{t:.2f}+{x:.2f}" for t, x in compiles[side.name]) or "none"
        print(
            f"{side.name:10} warm-up {trace:.2f}+{xla:.2f}; fresh {rep_text}; "
            f"median total {comp_total[side.name]:.2f} s"
        )
    for side in sides:
        st = stats[side.name]
        print(
            f"{side.name:10} XLA: {st['gflops']:.2f} GFLOP/step, {st['gbytes_accessed']:.3f} GB "
            f"accessed, temp {st['temp_mb']:.1f} MiB, donated {st['donated_mb']:.1f} MiB, "
            f"{st['hlo_lines']} HLO lines"
        )
    result = {
        "shape": name,
        "median": med,
        "compile": comp_total,
        "mfu": {n: model_flops / t / peak_flops for n, t in med.items()},
        "peak_flops": peak_flops,
        "gflops": {n: st["gflops"] for n, st in stats.items()},
        "tokens_per_s": {n: tokens / t for n, t in med.items()},
        "opcodes": {s.name: opcode_counts(cold[s.name][2].as_text()) for s in sides},
    }
    for other in [s.name for s in sides[1:]]:
        per_round = [
            x / y for x, y in zip(round_medians["axplug"], round_medians[other], strict=True)
        ]
        print(
            f"axplug/{other}: step {med['axplug'] / med[other]:.3f} (per round "
            + " ".join(f"{x:.3f}" for x in per_round)
            + f"; fastest steps {min(times['axplug']) / min(times[other]):.3f}), compile "
            f"{comp_total['axplug'] / comp_total[other]:.3f}"
        )
    return result


def print_summary(results: list[dict[str, Any]]) -> None:
    """One row per shape: median step times, ratios and compile ratios."""
    if not results:
        return
    names = list(results[0]["median"])
    others = names[1:]
    print("\n=== summary (ratios from one run; step = median step time) ===")
    head = f"{'shape':12}" + "".join(f" {n + ' ms':>14}" for n in names)
    head += "".join(f" {'ax/' + o + ' step':>20} {'compile':>8}" for o in others)
    print(head + f" {'axplug MFU':>10}")
    for r in results:
        row = f"{r['shape']:12}" + "".join(f" {r['median'][n] * 1e3:14.1f}" for n in names)
        for o in others:
            row += f" {r['median']['axplug'] / r['median'][o]:20.3f}"
            row += f" {r['compile']['axplug'] / r['compile'][o]:8.3f}"
        print(row + f" {r['mfu']['axplug']:10.1%}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    jax.config.update("jax_enable_compilation_cache", False)  # compile times must be real
    flax = not args.no_flax
    if flax:
        try:
            import flax.nnx  # noqa: F401
        except ImportError:
            print(
                "flax is not installed: pip install -r bench/requirements.txt (or pass --no-flax)",
                file=sys.stderr,
            )
            return 2
    print(
        f"{jax.device_count()} {jax.default_backend()} device(s), {os.cpu_count()} cores, "
        f"jax {jax.__version__}, load average {os.getloadavg()[0]:.2f}"
    )
    peak = matmul_peak.MatmulPeak()
    print(f"MFU denominator: {matmul_peak.DESCRIPTION}, sampled once per round")
    results = []
    for name in args.shapes:
        cfg = shape_config(name)
        try:
            plain_llama.spec_from_config(cfg)
        except ValueError as e:
            print(f"shape {name}: {e}", file=sys.stderr)
            return 2
        shape = SHAPES.get(name, Shape(name))
        rounds, steps, reps = shape.quick if args.quick else shape.full
        result = run_shape(
            name,
            cfg,
            rounds=args.rounds or rounds,
            steps_per_round=args.steps_per_round or steps,
            compile_reps=reps if args.compile_reps is None else args.compile_reps,
            peak=peak,
            peak_label="f32 matmul peak",
            flax=flax,
        )
        if result is None:
            return 1
        results.append(result)
    print_summary(results)
    first = results[0]
    print(
        f"axplug/plain-jax compile-time ratio: "
        f"{first['compile']['axplug'] / first['compile']['plain-jax']:.3f}"
    )
    print(
        f"axplug/plain-jax step-time ratio: "
        f"{first['median']['axplug'] / first['median']['plain-jax']:.3f}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
