"""Folding layers into the plain layers they compute as: a low-rank adapter merged into its
base weight before an export, or for decoding without the adapter's extra matmuls.

A layer class that folds defines `folded_config()` (the config of the class it becomes; the
fields the two share carry over) and `fold_parameters(cfg, params)` (its parameters as that
class's; `params` may carry leading axes, a scanned stack's layers).
"""

from __future__ import annotations

from typing import Any

from axplug.config import ConfigBase, replace_config
from axplug.config import visit as visit_configs

__all__ = ["fold_layers", "folded_config", "folds"]


def folds(module_or_class: Any) -> bool:
    """Whether a layer (or its class) folds into a plainer one."""
    cls = module_or_class if isinstance(module_or_class, type) else type(module_or_class)
    return hasattr(cls, "fold_parameters") and hasattr(cls, "folded_config")


def fold_layers(model_cfg: ConfigBase, params: dict) -> tuple[ConfigBase, dict]:
    """(model config, parameters) with every layer that folds replaced by what it folds into;
    both unchanged when none does. `params` is the model's tree (arrays of any kind)."""
    model = model_cfg.clone(name=model_cfg.name or "model").instantiate(parent=None)

    def visit(module: Any, tree: Any) -> Any:
        if folds(module):
            return type(module).fold_parameters(module.config, tree)
        children = module.children
        return {k: visit(children[k], v) if k in children else v for k, v in tree.items()}

    return folded_config(model_cfg), visit(model, params)


def folded_config(model_cfg: ConfigBase) -> ConfigBase:
    """The model config with every layer that folds replaced by what it folds into."""
    classes: set[type] = set()

    def collect(_path: str, value: Any) -> None:
        if isinstance(value, ConfigBase) and folds(getattr(value, "klass", None) or object):
            classes.add(value.klass)

    collect("", model_cfg)
    visit_configs(model_cfg, collect)
    for cls in sorted(classes, key=lambda c: c.__qualname__):
        model_cfg = replace_config(model_cfg, target=cls, new_cfg=cls.folded_config())
    return model_cfg
