"""fp8 training recipes against float: llama-tiny trained the same steps from the same start.

    python bench/fp8_recipes.py                 # 100 steps, every mode
    python bench/fp8_recipes.py --steps 20 --modes fp8_rowwise,mxfp8

Each side is the `llama-tiny` preset through the real Trainer on one CPU device with
`--modifier quantize:MODE` (attention and feed-forward projections; the head stays float):
`fp8` (delayed scaling), `fp8_tensorwise`, `fp8_rowwise`, `mxfp8` (current scaling), and
float. The table prints each side's mean loss over the last 10 steps, its ratio to float's
(the target: within 1%), and the step time (median; CPU emulates fp8 casts, so time is not
the point here: bench/gpu_quantize.sh times them on a GPU).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time


def train(mode: str, steps: int) -> tuple[list[float], float]:
    import jax
    from axplug_testing import train_steps

    from axplug.presets import preset_config

    modifiers = ["mesh"] if mode == "float" else ["mesh", f"quantize:{mode}"]
    cfg = preset_config("llama-tiny", modifiers=modifiers, overrides=[
        f"max_steps={steps}", "compilation_cache_dir=None", "output_dir='/nonexistent'",
    ])  # fmt: skip
    trainer = cfg.clone(summary_writers=[]).instantiate(devices=jax.devices()[:1])
    start = time.perf_counter()
    _, metrics = train_steps(trainer, steps)
    elapsed = time.perf_counter() - start
    return [float(m["loss"]) for m in metrics], elapsed / steps


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--modes", default="fp8,fp8_tensorwise,fp8_rowwise,mxfp8")
    args = p.parse_args(argv)
    base, base_time = train("float", args.steps)
    tail = lambda losses: statistics.mean(losses[-10:])  # noqa: E731
    print(
        f"| mode | loss (last 10 of {args.steps}) | x float | first loss | s/step (incl. compile) |"
    )
    print("| --- | --- | --- | --- | --- |")
    print(f"| float | {tail(base):.4f} | 1.0000 | {base[0]:.4f} | {base_time:.3f} |", flush=True)
    for mode in args.modes.split(","):
        losses, per_step = train(mode, args.steps)
        print(f"| {mode} | {tail(losses):.4f} | {tail(losses) / tail(base):.4f} | "
              f"{losses[0]:.4f} | {per_step:.3f} |", flush=True)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
