"""The f32 matmul throughput this machine reaches through XLA: the peak for CPU MFU.

    python bench/matmul_peak.py

`step_time.py` samples it once per timing round, between the sides' steps, so the peak it
divides by sees the same machine load as the steps do.
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp

__all__ = ["MatmulPeak", "measure", "DESCRIPTION"]

SIZE = 2048
REPS = 4
DESCRIPTION = f"best of {REPS} jitted {SIZE}x{SIZE} @ {SIZE}x{SIZE} float32 matmuls"


class MatmulPeak:
    """Compiled once; `sample()` is the FLOP/s of the fastest of `reps` matmuls now."""

    def __init__(self, size: int = SIZE):
        keys = jax.random.split(jax.random.PRNGKey(0))
        self.a, self.b = (jax.random.normal(k, (size, size), jnp.float32) for k in keys)
        self.flops = 2 * size**3
        self._matmul = jax.jit(jnp.matmul)
        jax.block_until_ready(self._matmul(self.a, self.b))  # compile and warm up

    def sample(self, reps: int = REPS) -> float:
        best = float("inf")
        for _ in range(reps):
            t0 = time.perf_counter()
            jax.block_until_ready(self._matmul(self.a, self.b))
            best = min(best, time.perf_counter() - t0)
        return self.flops / best


def measure(size: int = SIZE, reps: int = 2 * REPS) -> float:
    """FLOP/s of the fastest of `reps` [size, size] @ [size, size] float32 matmuls."""
    return MatmulPeak(size).sample(reps)


if __name__ == "__main__":
    print(f"{measure() / 1e9:.1f} GFLOP/s (best of {2 * REPS}, {jax.default_backend()})")
