"""Tree tools: find and swap sub-configs, and composable config modifiers."""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable
from typing import Any, TypeGuard

from axplug.config.base import (
    REQUIRED,
    ConfigBase,
    ConfigError,
    Configurable,
    InstantiableConfig,
    config_class,
    configurable_class,
)

__all__ = ["replace_config", "find_configs", "ConfigModifier", "ChainConfigModifier", "chain"]


def _resolve_target(target: type | str) -> type:
    if isinstance(target, str):
        from axplug.config.serialize import resolve_class

        return resolve_class(target, path=f"target {target!r}")
    return target


def _matches(value: Any, target: type) -> TypeGuard[InstantiableConfig]:
    return isinstance(value, InstantiableConfig) and value.klass is target


def find_configs(cfg: ConfigBase, target: type | str) -> list[tuple[str, InstantiableConfig]]:
    """Every `(dotted_path, sub_config)` whose class is `target`, in tree order."""
    from axplug.config.base import visit

    target_cls = _resolve_target(target)
    found = [("", cfg)] if _matches(cfg, target_cls) else []
    visit(cfg, lambda p, v: found.append((p, v)) if _matches(v, target_cls) else None)
    return found


def _fresh_default(cfg: ConfigBase) -> ConfigBase:
    klass = configurable_class(cfg)
    return klass.default_config() if klass is not None else type(cfg)()


def _carried(
    old: ConfigBase,
    new_cfg: ConfigBase,
    carry: Iterable[str] | None,
    owned: Iterable[str] | None,
) -> ConfigBase:
    new = copy.deepcopy(new_cfg)
    default = _fresh_default(new_cfg)
    old_fields = set(old.keys())
    forced, kept = set(carry or ()), set(owned or ())
    for name, value in new.items():
        if name in ("klass", "name") or name not in old_fields or name in kept:
            continue
        if name in forced or value is REQUIRED or value == getattr(default, name):
            setattr(new, name, copy.deepcopy(getattr(old, name)))
    return new


def replace_config(
    cfg: ConfigBase,
    *,
    target: type | str,
    new_cfg: InstantiableConfig,
    carry: Iterable[str] | None = None,
    owned: Iterable[str] | None = None,
    where: Callable[[str, InstantiableConfig], bool] | None = None,
    missing_ok: bool = False,
) -> ConfigBase:
    """A copy of `cfg` with every sub-config of class `target` replaced by a copy of `new_cfg`.

    Fields the two configs share take the replaced config's value where `new_cfg` leaves
    them at its class default (REQUIRED included), so dims, activations and nested layers
    carry over while what the caller set on `new_cfg` wins; fields named in `carry` are
    always carried, fields named in `owned` never are (a modifier's own options: re-applied
    with an option at its default, the default wins). `where(path, old)` narrows the match;
    paths are dotted from the root, whose own path is "". The caller's `cfg` and `new_cfg`
    are never mutated.
    """
    target_cls = _resolve_target(target)
    count = rejected = 0
    rejected_paths: list[str] = []

    def swap(path: str, value: Any) -> Any:
        nonlocal count, rejected
        if _matches(value, target_cls):
            if where is None or where(path, value):
                count += 1
                return _carried(value, new_cfg, carry, owned)
            rejected += 1
            rejected_paths.append(path or '""')
        if isinstance(value, ConfigBase):
            for key, child in value.items():
                new_child = swap(f"{path}.{key}".lstrip("."), child)
                if new_child is not child:
                    setattr(value, key, new_child)
        elif isinstance(value, list):
            value[:] = [swap(f"{path}[{i}]", v) for i, v in enumerate(value)]
        elif isinstance(value, tuple):
            return tuple(swap(f"{path}[{i}]", v) for i, v in enumerate(value))
        elif isinstance(value, dict):
            for key in list(value):
                value[key] = swap(f"{path}[{key!r}]", value[key])
        return value

    result = swap("", copy.deepcopy(cfg))
    if count == 0 and rejected and not missing_ok:
        shown = ", ".join(rejected_paths[:5]) + (" ..." if len(rejected_paths) > 5 else "")
        raise ConfigError(
            f"replace_config: {rejected} sub-config(s) of class {target_cls.__qualname__} "
            f"found, but `where` rejected every one (paths: {shown}); paths are dotted from "
            'the root, whose path is ""'
        )
    if count == 0 and not missing_ok:
        raise ConfigError(
            f"replace_config: no sub-config of class {target_cls.__qualname__} "
            f"({target_cls.__module__}) found in {type(cfg).__qualname__}; pass "
            "missing_ok=True if that is expected"
        )
    return result


class ConfigModifier(Configurable):
    """Maps a config to a new config; the input is never mutated."""

    def __call__(self, cfg: ConfigBase) -> ConfigBase:
        raise NotImplementedError(type(self).__qualname__)


class ChainConfigModifier(ConfigModifier):
    """Applies its modifiers in order."""

    @config_class
    class Config(ConfigModifier.Config):
        modifiers: list = []

    def __init__(self, cfg: Config):
        super().__init__(cfg)
        self._modifiers = [m.instantiate() for m in cfg.modifiers]

    def __call__(self, cfg: ConfigBase) -> ConfigBase:
        for modifier in self._modifiers:
            cfg = modifier(cfg)
        return cfg


def chain(*modifiers: ConfigModifier) -> ChainConfigModifier:
    """One modifier that applies `modifiers` left to right."""
    for m in modifiers:
        if not isinstance(m, ConfigModifier):
            raise ConfigError(f"chain: {m!r} is not a ConfigModifier")
    return (
        ChainConfigModifier.default_config()
        .set(modifiers=[m._config for m in modifiers])
        .instantiate()
    )
