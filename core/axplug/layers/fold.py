"""Folding layers into the plain layers they compute as: a low-rank adapter merged into its
base weight before an export, or for decoding without the adapter's extra matmuls.

A layer class that folds overrides the classmethods `folded_config(cfg)` (its config once
folded) and `fold_parameters(cfg, params)` (its parameters then; `params` may carry leading
axes, a scanned stack's layers), which `BaseLayer` declares as the identity: the core `Linear`
folds its adapter into its weight.
"""

from __future__ import annotations

import copy
from typing import Any

from axplug.config import ConfigBase, configurable_class
from axplug.layers.base import BaseLayer

__all__ = ["fold_layers", "folded_config"]


def fold_layers(model_cfg: ConfigBase, params: dict) -> tuple[ConfigBase, dict]:
    """(model config, parameters) with every layer that folds replaced by what it folds into;
    both unchanged when none does. `params` is the model's tree (arrays of any kind)."""
    model = model_cfg.clone(name=model_cfg.name or "model").instantiate(parent=None)

    def visit(module: Any, tree: Any) -> Any:
        children = module.children
        tree = {k: visit(children[k], v) if k in children else v for k, v in tree.items()}
        return type(module).fold_parameters(module.config, tree)

    return folded_config(model_cfg), visit(model, params)


def folded_config(model_cfg: ConfigBase) -> ConfigBase:
    """A copy of the model config with every layer that folds as it is once folded (its
    sub-configs first)."""
    return _fold(copy.deepcopy(model_cfg))


def _fold(value: Any) -> Any:
    if isinstance(value, (list, tuple)):
        return type(value)(_fold(v) for v in value)
    if isinstance(value, dict):
        return {k: _fold(v) for k, v in value.items()}
    if not isinstance(value, ConfigBase):
        return value
    for name, field in list(value.items()):
        folded = _fold(field)
        if folded is not field:
            setattr(value, name, folded)
    klass = configurable_class(value)
    return klass.folded_config(value) if klass and issubclass(klass, BaseLayer) else value
