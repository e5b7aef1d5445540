"""MoE dispatch variants against the dense-einsum (GShard one-hot) form and the dense model.

    python bench/moe_dispatch.py [--experts 8] [--top-k 2] [--hidden H] [--capacity-factor 1.25]
                                 [--rounds 3] [--steps-per-round 2] [--dropless] [--no-ragged]
                                 [--quick]

Every side is the `llama-tiny` preset through the real Trainer on one device: `dense` (no
modifier); `moe:num_experts=E,top_k=K,capacity_factor=F,dispatch=X` for X in einsum (the
dense-einsum GShard form, the baseline), gather and ragged; and the drop-free
`capacity_factor=None,dispatch=balanced` (`--dropless` adds drop-free einsum and gather, which
execute num_experts / top_k x the expert FLOPs). All MoE sides start from the same
parameters, and sides with the same capacity must agree on the first-step loss (1e-4
relative), or the script exits 1 before timing. Steps are timed in alternating rounds so
load from other processes hits every side alike; ratios are from this one run.

Columns: step time (median of rounds), that time over the einsum side's and over the dense
side's, XLA's executed FLOPs (`compile().cost_analysis()`, layers unrolled so nothing is
counted once per scan; for `balanced`, the overflow rows the first step's loop ran in place
of the one loop body XLA counts) and their ratio to the model FLOPs: 6 x tokens x active
matmul parameters (top_k of num_experts experts, router, attention, LM head; no embedding
lookup) + 12 x layers x batch x seq^2 x dim for attention scores, forward and backward.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from typing import Any

import jax
import numpy as np

LOSS_RTOL = 1e-4


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--hidden", type=int, default=None, help="per expert (the dense width)")
    p.add_argument("--capacity-factor", type=float, default=1.25)
    p.add_argument("--rounds", type=int, default=None, help="alternating rounds (3)")
    p.add_argument("--steps-per-round", type=int, default=None, help="steps per side (2)")
    p.add_argument("--dropless", action="store_true", help="add drop-free einsum and gather")
    p.add_argument("--no-ragged", action="store_true", help="skip ragged (slow on CPU)")
    p.add_argument("--quick", action="store_true", help="2 rounds x 1 step")
    args = p.parse_args(argv)
    defaults = (2, 1) if args.quick else (3, 2)
    args.rounds = args.rounds or defaults[0]
    args.steps_per_round = args.steps_per_round or defaults[1]
    return args


def trainer_config(modifiers: list[str], workdir: str) -> Any:
    from axplug.presets import preset_config

    return preset_config(
        "llama-tiny",
        modifiers=modifiers,
        overrides=[
            f"output_dir={workdir!r}",
            "mesh.mesh_shape=(1, 1, 1, 1, 1)",
            "compilation_cache_dir=None",
            "summary_writers=[]",
        ],
    )


def model_flops(trainer: Any) -> float:
    """Analytic FLOPs of one training step (see the module docstring)."""
    from axplug_moe import MoEFeedForward

    from axplug.layers import Attention, Embedding

    active, attention_dims = 0.0, []

    def walk(module):
        nonlocal active
        specs = module._create_layer_parameter_specs()
        sizes = sum(int(np.prod(s.shape)) for s in specs.values() if len(s.shape) >= 2)
        if isinstance(module, MoEFeedForward):
            cfg = module._config
            sizes *= cfg.router.top_k / cfg.num_experts
        if not isinstance(module, Embedding):
            active += sizes
        if isinstance(module, Attention):
            cfg = module._config
            attention_dims.append(cfg.num_heads * (cfg.input_dim // cfg.num_heads))
        for child in module.children.values():
            walk(child)

    walk(trainer.model)
    icfg = trainer._config.input
    b, s = icfg.batch_size, icfg.seq_len
    return 6.0 * b * s * active + sum(12.0 * b * s * s * d for d in attention_dims)


def overflow_flops(trainer: Any, loop_rows: float) -> float:
    """FLOPs of the `balanced` overflow loop that XLA's cost analysis leaves out: it counts
    the loop body once (forward and backward) whatever the trip count, so count the rows
    the loop ran (`moe/overflow_rows`, per layer) instead of one body."""
    from axplug_moe import BalancedDispatch, MoEFeedForward

    total = 0.0

    def walk(module):
        nonlocal total
        if isinstance(module, MoEFeedForward) and isinstance(module.dispatch, BalancedDispatch):
            cfg = module._config
            icfg = trainer._config.input
            choices = icfg.batch_size * icfg.seq_len * cfg.router.top_k
            counted = module.dispatch.tile(choices)  # one body
            matmuls = 3 if cfg.gated else 2
            # forward: the FFN's matmuls; backward: two per matmul (no recompute).
            per_row = 2.0 * cfg.input_dim * cfg.hidden_dim * matmuls * 3
            total += (loop_rows - counted) * per_row
        for child in module.children.values():
            walk(child)

    walk(trainer.model)
    return total


class Side:
    def __init__(self, name: str, modifiers: list[str], workdir: str):
        self.name = name
        cfg = trainer_config(modifiers, f"{workdir}/{name}")
        self.trainer = cfg.instantiate(devices=jax.devices()[:1])
        self.batch = self.trainer.put_batch(self.trainer.input.batch(0))
        self.state = self.trainer.init_state()
        t = time.perf_counter()
        compiled = self.trainer._train_step.lower(self.state, self.batch).compile()
        self.compile_s = time.perf_counter() - t
        self.executed = float(compiled.cost_analysis()["flops"])
        self.model = model_flops(self.trainer)
        self._step = compiled
        self.times: list[float] = []
        self.first_loss = None
        self.overflow_rows = 0.0

    def params_from(self, other: Side) -> None:
        """Start from `other`'s parameters (same tree: only the dispatch differs)."""
        self.state = jax.tree.map(lambda x: x.copy(), other.state)

    def run(self, steps: int) -> None:
        jax.block_until_ready(self.state)
        t = time.perf_counter()
        for _ in range(steps):
            self.state, metrics = self._step(self.state, self.batch)
            if self.first_loss is None:
                self.first_loss = float(metrics["loss"])
                self.overflow_rows = float(metrics.get("moe/overflow_rows", 0.0))
                self.executed += overflow_flops(self.trainer, self.overflow_rows)
        jax.block_until_ready(self.state)
        self.times.append((time.perf_counter() - t) / steps)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    e, k, f = args.experts, args.top_k, args.capacity_factor
    moe = f"moe:num_experts={e},top_k={k}" + (f",hidden_dim={args.hidden}" if args.hidden else "")
    capped = f"{moe},capacity_factor={f}"
    dropless = f"{moe},capacity_factor=None"
    # (name, modifier, drop-free); sides of one kind must agree on the first-step loss.
    variants = [("einsum", f"{capped},dispatch=einsum", False)]
    variants.append(("gather", f"{capped},dispatch=gather", False))
    if not args.no_ragged:
        variants.append(("ragged", f"{capped},dispatch=ragged", False))
    variants.append(("balanced-dropfree", f"{dropless},dispatch=balanced", True))
    if args.dropless:
        variants.append(("einsum-dropfree", f"{dropless},dispatch=einsum", True))
        variants.append(("gather-dropfree", f"{dropless},dispatch=gather", True))
    print(
        f"backend {jax.default_backend()}, llama-tiny, {e} experts top-{k}, capacity "
        f"factor {f} unless drop-free; {args.rounds} rounds x {args.steps_per_round} steps"
    )
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as workdir:
        sides = [Side("dense", [], workdir)]
        kinds = {}
        for name, spec, drop_free in variants:
            side = Side(name, [spec], workdir)
            if len(sides) > 1:
                side.params_from(sides[1])  # one parameter tree: only the dispatch differs
            sides.append(side)
            kinds[name] = drop_free
        for side in sides:  # warm-up step (also the first loss), not timed
            side.run(1)
            side.times.clear()
        for drop_free in (False, True):
            group = [s for s in sides[1:] if kinds[s.name] == drop_free]
            for side in group[1:]:
                if not np.isclose(side.first_loss, group[0].first_loss, rtol=LOSS_RTOL, atol=0):
                    print(
                        f"first-step loss of {side.name} ({side.first_loss:.6f}) differs from "
                        f"{group[0].name} ({group[0].first_loss:.6f}) beyond {LOSS_RTOL}"
                    )
                    return 1
        for r in range(args.rounds):
            for side in sides if r % 2 == 0 else sides[::-1]:
                # ragged runs every expert on every choice on CPU: fewer steps, same rounds.
                slow = side.name == "ragged" and jax.default_backend() == "cpu"
                side.run(max(1, args.steps_per_round // 2) if slow else args.steps_per_round)
    med = {s.name: statistics.median(s.times) for s in sides}
    print(
        f"{'side':16s} {'step s':>8s} {'/einsum':>8s} {'/dense':>8s} {'GFLOP exec':>11s} "
        f"{'GFLOP model':>12s} {'exec/model':>10s} {'compile s':>9s}"
    )
    for s in sides:
        print(
            f"{s.name:16s} {med[s.name]:8.3f} {med[s.name] / med['einsum']:8.2f} "
            f"{med[s.name] / med['dense']:8.2f} {s.executed / 1e9:11.1f} "
            f"{s.model / 1e9:12.1f} {s.executed / s.model:10.2f} {s.compile_s:9.1f}"
        )
    print(f"total {time.perf_counter() - start:.0f} s")
    dense = sides[0]
    for s in sides[1:]:
        step = med[s.name] / med["dense"]
        flops = s.model / dense.model
        spread = [t / med["dense"] for t in (min(s.times), max(s.times))]
        print(
            f"{s.name}: step/dense {step:.3f} [{spread[0]:.3f}-{spread[1]:.3f}] for "
            f"{flops:.3f}x the model FLOPs: {step / flops:.3f}x the dense time per model FLOP"
            + (f"; overflow rows per layer {s.overflow_rows:.0f}" if s.overflow_rows else "")
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
