"""The rule that adds auxiliary losses emitted by layers (module outputs) to the training loss."""

from __future__ import annotations

import fnmatch
from typing import Any

import jax
import jax.numpy as jnp

from axplug.config import Configurable, config_class

__all__ = ["AuxLossRule", "collect_outputs"]


def collect_outputs(module_outputs: Any) -> list[tuple[str, str, jax.Array]]:
    """Every module output as (dotted module path, output name, value)."""
    found = []
    for path, value in jax.tree_util.tree_flatten_with_path(module_outputs)[0]:
        keys = [str(getattr(k, "key", k)) for k in path]
        found.append((".".join(keys[:-1]), keys[-1], value))
    return found


class AuxLossRule(Configurable):
    """Every module output whose name matches `pattern` is an aux loss.

    Each is summed over the layers and calls that emitted it, multiplied by `weights[name]`
    (default 1.0), and added to the loss; the sums are also reported per name. Excluding a
    loss takes an explicit weight of 0, so none can fall out of the loss by accident.
    """

    @config_class
    class Config(Configurable.Config):
        pattern: str = "*_loss"
        weights: dict[str, float] = {}

    _config: Config

    def __call__(self, module_outputs: Any) -> tuple[jax.Array, dict[str, jax.Array]]:
        cfg = self._config
        per_name: dict[str, jax.Array] = {}
        for _, name, value in collect_outputs(module_outputs):
            if fnmatch.fnmatchcase(name, cfg.pattern):
                per_name[name] = per_name.get(name, 0.0) + jnp.sum(value.astype(jnp.float32))
        total = sum(
            (cfg.weights.get(name, 1.0) * value for name, value in per_name.items()),
            jnp.zeros((), jnp.float32),
        )
        return total, per_name
