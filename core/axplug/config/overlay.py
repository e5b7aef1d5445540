"""Config overlays: a partial tree (from a YAML, TOML or JSON file) applied over a config,
each leaf set and checked as `--set` would set it, so errors name the dotted path."""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any, TypeVar

from axplug.config.base import ConfigBase, ConfigError
from axplug.config.overrides import set_field

__all__ = ["apply_overlay", "overlay_items"]

_Config = TypeVar("_Config", bound=ConfigBase)


def overlay_items(cfg: ConfigBase, tree: Mapping[str, Any], prefix: str = "") -> list:
    """(dotted path, value) of each leaf of `tree` against `cfg`: a mapping under a field that
    holds a config is descended into (unless it names a `klass`: a replacement); any other
    value, a dict field's mapping included, is a leaf. Dotted keys (`learner.b1: 0.9`) work."""
    items = []
    for key, value in tree.items():
        if not isinstance(key, str) or not key:
            raise ConfigError(f"{prefix or '<root>'}: key {key!r} is not a field name")
        path = f"{prefix}{key}"
        node: Any = cfg
        for part in key.split("."):
            node = getattr(node, part, None) if isinstance(node, ConfigBase) else None
        if isinstance(value, Mapping) and isinstance(node, ConfigBase) and "klass" not in value:
            items += overlay_items(node, value, f"{path}.")
        else:
            items.append((path, value))
    return items


def apply_overlay(cfg: _Config, tree: Mapping[str, Any], *, trusted: bool = False) -> _Config:
    """A copy of `cfg` with every leaf of the partial tree `tree` set (see `overlay_items`)."""
    cfg = copy.deepcopy(cfg)
    for path, value in overlay_items(cfg, tree):
        set_field(cfg, path, value, trusted=trusted)
    return cfg
