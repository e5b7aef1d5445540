"""Compile time of a run's state-initialisation program: the parameters' PRNG keys derived
in the program (each key a `fold_in` hash, compiled as its own loop) against the Trainer's
way (keys derived op by op before it, the program drawing only the parameters).

    python bench/init_compile.py [--presets llama-tiny,gpt-tiny,moe-tiny] [--reps 5]
                                 [--modifiers lora:4]

Each side compiles `--reps` times from a fresh trace (jax's caches cleared, no persistent
cache), the sides interleaved so load from other processes hits both alike; the table gives
the median seconds with the range and the ratio in-program / Trainer. Both sides must draw
bit-identical parameters (checked first): the seed keeps its meaning.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["sides", "main"]


def sides(trainer) -> dict:
    """{name: (jitted init, its argument)} for the two ways of deriving the keys."""
    key = jax.random.PRNGKey(trainer.config.seed)

    def state(params):
        return {"params": params, "opt_state": trainer.layout.init_opt_state(params),
                "step": jnp.zeros((), jnp.int32)}  # fmt: skip

    def in_program(key):
        return state(trainer.model.initialize_parameters_recursively(key))

    def drawn(keys):
        return state(trainer.model.initialize_parameters(keys))

    keys = jax.device_get(trainer.model.parameter_keys(key))
    shardings = trainer.layout.shardings
    return {
        "keys in program": (lambda: jax.jit(in_program, out_shardings=shardings), key),
        "keys before it": (lambda: jax.jit(drawn, out_shardings=shardings), keys),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--presets", default="llama-tiny,gpt-tiny,moe-tiny")
    p.add_argument("--modifiers", default="", help="comma-separated modifiers for every preset")
    p.add_argument("--reps", type=int, default=5)
    args = p.parse_args(argv)
    jax.config.update("jax_enable_compilation_cache", False)
    from axplug_testing import tiny_trainer_config

    modifiers = [m for m in args.modifiers.split(",") if m]
    print(f"{'preset':<16} {'keys in program (s)':>22} {'keys before it (s)':>22} {'ratio':>6}")
    for preset in args.presets.split(","):
        cfg = tiny_trainer_config(tempfile.mkdtemp(), preset=preset, modifiers=modifiers)
        trainer = cfg.instantiate(devices=jax.devices()[:1])
        made = sides(trainer)
        outs = [jax.device_get(make()(arg)) for make, arg in made.values()]
        for a, b in zip(*(jax.tree.leaves(o) for o in outs), strict=True):
            np.testing.assert_array_equal(a, b)
        times: dict[str, list[float]] = {name: [] for name in made}
        for _ in range(args.reps):
            for name, (make, arg) in made.items():
                jax.clear_caches()
                lowered = make().lower(arg)
                t0 = time.perf_counter()
                lowered.compile()
                times[name].append(time.perf_counter() - t0)
        cells = [f"{statistics.median(t):.3f} ({min(t):.3f}-{max(t):.3f})" for t in times.values()]
        ratio = statistics.median(times["keys in program"]) / statistics.median(
            times["keys before it"]
        )
        print(f"{preset:<16} {cells[0]:>22} {cells[1]:>22} {ratio:>5.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
