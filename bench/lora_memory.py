"""LoRA against full fine-tuning: optimizer-state bytes, compiled memory, FLOPs and step time.

    python bench/lora_memory.py                          # llama-tiny at dim 512, 4 layers, CPU
    python bench/lora_memory.py --rank 64 --set model.decoder.dim=1024

Each variant's train step is compiled once (deterministic: optimizer-state bytes from the
state's layout, argument/temp bytes from `memory_analysis()`, FLOPs from `cost_analysis()`);
then `--rounds` rounds run `--steps` steps of each variant in turn (interleaved, so a noisy
machine slows all alike). Printed as ratios to full fine-tuning, step time as the median of
the rounds' medians with its min-max spread.
"""

from __future__ import annotations

import argparse
import statistics
import time


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="llama-tiny")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--set", action="append", default=[], metavar="PATH=VALUE")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=3)
    return p.parse_args(argv)


def _bytes(tree) -> int:
    import jax

    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))


def main(argv=None) -> None:
    args = parse_args(argv)
    import jax

    from axplug.presets import preset_config

    shape = ["model.decoder.dim=512", "model.decoder.transformer.num_layers=4",
             "model.decoder.transformer.layer.feed_forward.hidden_dim=1408", "input.seq_len=256",
             "input.batch_size=4"]  # fmt: skip
    variants = {
        "full": [],
        f"lora-r{args.rank}": [f"lora:rank={args.rank}"],
        f"qlora-int8-r{args.rank}": ["quantize:int8", f"lora:rank={args.rank}"],
    }
    rows = {}
    for name, modifiers in variants.items():
        cfg = preset_config(args.preset, modifiers=modifiers, overrides=[
            "output_dir='/tmp/axplug-bench-lora'", "compilation_cache_dir=None",
            "summary_writers=[]", *shape, *args.set])  # fmt: skip
        trainer = cfg.instantiate(devices=jax.devices()[:1])
        state = trainer.init_state()
        batch = trainer.put_batch(trainer.input.batch(0))
        compiled = trainer._train_step.lower(state, batch).compile()
        memory = compiled.memory_analysis()
        cost = compiled.cost_analysis()
        cost = cost[0] if isinstance(cost, list) else cost
        trained = jax.tree.leaves(state["opt_state"])
        rows[name] = {
            "trainer": trainer, "step": compiled, "state": state, "batch": batch, "times": [],
            "params": _bytes(state["params"]), "opt": _bytes(trained),
            "args": memory.argument_size_in_bytes, "temp": memory.temp_size_in_bytes,
            "flops": float(cost.get("flops", 0.0)),
        }  # fmt: skip
    for _ in range(args.rounds):
        for row in rows.values():
            state = row["state"]
            state, _ = row["step"](state, row["batch"])  # warm
            jax.block_until_ready(state)
            times = []
            for _ in range(args.steps):
                t0 = time.perf_counter()
                state, _ = row["step"](state, row["batch"])
                jax.block_until_ready(state)
                times.append(time.perf_counter() - t0)
            row["state"] = state
            row["times"].append(statistics.median(times))
    full = rows["full"]
    print(
        f"{args.preset} ({', '.join(shape + args.set)}), {args.rounds} rounds x {args.steps} steps"
    )
    print(f"{'variant':<20}{'opt state MB':>14}{'args MB':>10}{'temp MB':>10}{'GFLOP':>10}"
          f"{'step ms (min-max)':>24}{'opt x':>8}{'args x':>8}{'flops x':>9}"
          f"{'time x':>8}")  # fmt: skip
    for name, row in rows.items():
        med = statistics.median(row["times"])
        spread = f"{1e3 * med:.1f} ({1e3 * min(row['times']):.1f}-{1e3 * max(row['times']):.1f})"
        print(f"{name:<20}{row['opt'] / 2**20:>14.2f}{row['args'] / 2**20:>10.2f}"
              f"{row['temp'] / 2**20:>10.2f}{row['flops'] / 1e9:>10.2f}{spread:>24}"
              f"{row['opt'] / full['opt']:>8.3f}{row['args'] / full['args']:>8.3f}"
              f"{row['flops'] / max(full['flops'], 1):>9.3f}"
              f"{med / statistics.median(full['times']):>8.3f}")  # fmt: skip


if __name__ == "__main__":
    main()
