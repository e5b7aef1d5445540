"""What a compiled step says of itself: its collectives, XLA's FLOPs count, and its dump."""

from __future__ import annotations

import contextlib
import json
import os
import re
from typing import Any

__all__ = ["DUMP_FILES", "count_collectives", "dump_step", "no_persistent_cache", "xla_flops"]

_COLLECTIVES = (
    "all-gather", "reduce-scatter", "all-reduce", "all-to-all", "ragged-all-to-all",
    "collective-permute",
)  # fmt: skip


def count_collectives(hlo_text: str) -> dict[str, int]:
    """How many of each collective op a compiled (partitioned) HLO module holds."""
    counts = {}
    for op in _COLLECTIVES:
        # An async collective is a `-start`/`-done` pair: count its start only. The result
        # shape before the op can hold `/*index=5*/` comments (tuples of 6+), so match the
        # op's own name: instruction names are followed by ` =`, metadata uses `_`.
        n = len(re.findall(rf" {op}(?:-start)?\(", hlo_text))
        if n:
            counts[op] = n
    return counts


def _cost_analysis(compiled) -> dict[str, Any]:
    """XLA's cost analysis of `compiled` (the first module's), {} where the backend has none."""
    try:
        cost = compiled.cost_analysis()
    except Exception:  # noqa: BLE001 - not every backend implements it
        return {}
    if isinstance(cost, list | tuple):
        cost = cost[0] if cost else {}
    return cost or {}


def xla_flops(compiled) -> float | None:
    """XLA's FLOPs per device of `compiled` (a loop's body counted once), None if unknown."""
    flops = _cost_analysis(compiled).get("flops")
    return float(flops) if flops is not None else None


DUMP_FILES = {
    "before": "train_step.before_optimizations.mlir",
    "after": "train_step.after_optimizations.hlo.txt",
    "analysis": "train_step.analysis.json",
}


@contextlib.contextmanager
def no_persistent_cache():
    """Compiles inside skip JAX's persistent compilation cache (read and write)."""
    import jax

    before = jax.config.jax_enable_compilation_cache  # type: ignore[attr-defined]
    jax.config.update("jax_enable_compilation_cache", False)
    try:
        yield
    finally:
        jax.config.update("jax_enable_compilation_cache", before)


def dump_step(lowered, compiled, directory: str, memory: dict[str, int]) -> dict[str, str]:
    """Writes a lowered and compiled step to `directory`: the StableHLO before XLA's passes
    (with locations: each op's module path, e.g. `decoder/transformer/layer0/attention/...`),
    the optimized HLO (per device, after SPMD partitioning; `metadata={op_name=...}` names the
    module path) and the memory (per device, bytes) and cost analysis as JSON. Returns the
    paths written, by kind."""
    os.makedirs(directory, exist_ok=True)
    paths = {kind: os.path.join(directory, name) for kind, name in DUMP_FILES.items()}
    with open(paths["before"], "w", encoding="utf-8") as f:
        f.write(lowered.as_text(debug_info=True))
    with open(paths["after"], "w", encoding="utf-8") as f:
        f.write(compiled.as_text())
    cost = _cost_analysis(compiled)
    analysis = {
        "memory_per_device_bytes": memory,
        "cost_analysis": {k: float(v) for k, v in cost.items() if isinstance(v, int | float)},
    }
    with open(paths["analysis"], "w", encoding="utf-8") as f:
        json.dump(analysis, f, indent=2, sort_keys=True)
    return paths
