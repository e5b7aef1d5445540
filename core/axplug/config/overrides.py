"""`--set path=value` overrides: values parsed as Python literals, never evaluated."""

from __future__ import annotations

import ast
import copy
from collections.abc import Iterable
from typing import Any, TypeVar

import attrs

from axplug.config.base import (
    ConfigBase,
    ConfigError,
    Configurable,
    UnknownFieldError,
    _field_types,
    _suggest,
)
from axplug.config.serialize import _allows, decode

__all__ = ["parse_value", "apply_overrides", "set_field"]

_WORDS = {"true": True, "false": False, "none": None, "null": None}

_Config = TypeVar("_Config", bound=ConfigBase)


def parse_value(text: str) -> Any:
    """A Python literal (int, float, bool, None, str, list, tuple, dict) or the raw string."""
    stripped = text.strip()
    if stripped.lower() in _WORDS:
        return _WORDS[stripped.lower()]
    try:
        return ast.literal_eval(stripped)
    except (ValueError, SyntaxError, MemoryError, RecursionError):
        return text


def _navigate(cfg: ConfigBase, parts: list[str], spec: str) -> ConfigBase:
    node = cfg
    for i, part in enumerate(parts):
        if not isinstance(node, ConfigBase):
            raise ConfigError(f"{'.'.join(parts[:i])}: is not a config; cannot set {spec!r}")
        fields = list(attrs.fields_dict(type(node)))
        if part not in fields:
            raise UnknownFieldError(
                f"{'.'.join(parts[: i + 1])}: unknown field{_suggest(part, fields, type(node))}"
            )
        node = getattr(node, part)
    if not isinstance(node, ConfigBase):
        raise ConfigError(f"{'.'.join(parts)}: is not a config; cannot set {spec!r}")
    return node


def apply_overrides(cfg: _Config, overrides: Iterable[str]) -> _Config:
    """A copy of `cfg` with each `dotted.path=value` applied in order."""
    cfg = copy.deepcopy(cfg)
    for spec in overrides:
        path, sep, text = spec.partition("=")
        if not sep or not path.strip():
            raise ConfigError(f"override {spec!r}: expected PATH=VALUE, e.g. model.num_layers=8")
        set_field(cfg, path.strip(), text, spec=spec)
    return cfg


def set_field(cfg: ConfigBase, path: str, value: Any, *, spec: str | None = None,
              trusted: bool = True) -> None:  # fmt: skip
    """Sets the field at dotted `path` of `cfg` in place, checked like `--set`: a str value
    is parsed as `--set`'s text is (a literal, else the string), others are taken as they are
    (a dict with `klass` becomes a config)."""
    parts = path.split(".")
    node = _navigate(cfg, parts[:-1], spec or path)
    name = parts[-1]
    fields = list(attrs.fields_dict(type(node)))
    if name not in fields:
        raise UnknownFieldError(f"{path}: unknown field{_suggest(name, fields, type(node))}")
    tp = _field_types(type(node)).get(name, Any)
    if isinstance(value, str):
        text, value = value, parse_value(value)
        if not isinstance(value, str) and _allows(tp, str) and not _allows(tp, type(value)):
            value = text  # e.g. `name=123` for a str field stays a string
    value = decode(value, tp, path, trusted=trusted)
    if name == "klass":
        _check_klass_swap(node, value, path)
    setattr(node, name, value)


def _check_klass_swap(node: ConfigBase, klass: Any, path: str) -> None:
    """A `klass` override keeps the config's fields, so it only works for a class with the
    same Config; anything else would fail later, far from the cause."""
    if not (isinstance(klass, type) and issubclass(klass, Configurable)):
        return
    if isinstance(node, klass.Config):  # the same fields: a swap that works
        return
    where = path.rsplit(".", 1)[0] if "." in path else "the root"
    hint = (
        " use --input NAME[:k=v,...] to change the input (axplug list --kind inputs)"
        if where == "input"
        else " use a modifier that swaps it (axplug list --kind modifiers)"
    )
    raise ConfigError(
        f"{path}: {klass.__qualname__} has its own Config ({klass.Config.__qualname__}) and "
        f"{where}'s fields ({type(node).__qualname__}) do not fit it; setting klass alone "
        f"cannot work:{hint}"
    )
