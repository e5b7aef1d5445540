"""What the rollouts input keeps beside the trainer's parameters: a held batch as JSON (saved
with a checkpoint), and the adapters-off reference."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from axplug.api.config import ConfigError

__all__ = ["adapters_off", "array_to_json", "array_from_json"]


def adapters_off(params: Any) -> Any:
    """`params` with every adapter's parameters (those under a Linear's `adapter` child) at
    zero: with LoRA, exactly the base model, without copying it."""
    import jax
    import jax.numpy as jnp

    def off(path, leaf):
        names = [str(getattr(p, "key", getattr(p, "name", p))) for p in path]
        return jnp.zeros_like(leaf) if "adapter" in names else leaf

    zeroed = jax.tree_util.tree_map_with_path(off, params)
    if jax.tree_util.tree_all(jax.tree_util.tree_map(lambda a, b: a is b, zeroed, params)):
        raise ConfigError("reference=adapters_off: the model has no adapters (--modifier lora)")
    return zeroed


def array_to_json(array: np.ndarray) -> dict:
    values = array.tolist()
    if array.dtype.kind == "f":  # JSON has no NaN: a stop token's missing log-probability
        values = [[None if math.isnan(v) else v for v in row] for row in values]
    return {"dtype": str(array.dtype), "values": values}


def array_from_json(entry: dict) -> np.ndarray:
    values = np.array(entry["values"], dtype=object)
    values[values == None] = np.nan  # noqa: E711 - elementwise
    return values.astype(entry["dtype"])
