"""`to_dict` / `from_dict`: configs as JSON-compatible dicts, classes named, never pickled.

Trust: a dict from a file or a checkpoint's metadata is data, and `from_dict` treats it so
unless told `trusted=True`. Untrusted, a class or function named in it resolves only inside
the core (`axplug`) or a package of an installed, enabled axplug plugin distribution (the
code the user chose to install), never by importing any other module; a `config_class` must
be a config class and a `klass` a configurable class. Fields a config class lists in
`CODE_FIELDS` (strings naming a function, e.g. `IteratorInput.make_iterator`) obey the same
rule. The user's own `--set` and Python build trusted configs and stay free.
"""

from __future__ import annotations

import functools
import importlib
import logging
import re
import typing
from typing import Any

import attrs

from axplug.config.base import (
    REQUIRED,
    ConfigBase,
    ConfigError,
    ConfigTypeError,
    Configurable,
    UnknownFieldError,
    _field_types,
    _suggest,
    configurable_class,
)

_log = logging.getLogger("axplug.config")

__all__ = ["to_dict", "from_dict", "class_name", "resolve_class", "UntrustedCodeError"]

_QUALNAME = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_][\w.]*$")
# How an unset REQUIRED field is written: unambiguous even for string fields.
_REQUIRED_MARK = {"axplug": "REQUIRED"}
_SEARCH_KINDS = (
    "layers",
    "kernels",
    "modifiers",
    "storage",
    "mesh_rules",
    "presets",
    "inputs",
    "summary_writers",
)


class UntrustedCodeError(ConfigError):
    """Untrusted config data named code outside the core and the installed plugins."""


def _trusted_packages() -> set[str]:
    """Top-level packages whose code an untrusted config may name: the core and the installed,
    enabled axplug plugin distributions."""
    from axplug import registry

    packages = {"axplug"}
    for component in registry.discover():
        if component.loadable:
            packages.add(component.value.split(":")[0].split(".")[0])
    return packages


def _disabled_packages() -> dict[str, str]:
    """{top-level package: distribution} of the plugins AXPLUG_DISABLE_PLUGINS or
    AXPLUG_LOAD_PLUGINS turn off."""
    from axplug import registry

    return {
        c.value.split(":")[0].split(".")[0]: c.distribution
        for c in registry.discover()
        if c.status == "disabled"
    }


def check_enabled_reference(name: str, path: str) -> None:
    """ConfigError when `name` (`module:Qualname`) lies in a plugin the user turned off."""
    package = name.partition(":")[0].split(".")[0]
    dist = _disabled_packages().get(package)
    if dist is not None:
        raise ConfigError(
            f"{path}: {name!r} is code of {dist}, which is disabled "
            f"({_env_names()}); it was not imported. Enable {dist} to load this "
            "config, or replace the component"
        )


def _env_names() -> str:
    from axplug.registry import ALLOW_ENV, DISABLE_ENV

    return f"{DISABLE_ENV} / {ALLOW_ENV}"


def check_trusted_reference(name: str, path: str) -> None:
    """Raise UntrustedCodeError unless `name` (`module:Qualname`) lies in a trusted package."""
    package = name.partition(":")[0].split(".")[0]
    if package not in _trusted_packages():
        raise UntrustedCodeError(
            f"{path}: {name!r} names code outside axplug and its installed plugins in an "
            "untrusted config (a checkpoint's metadata or a file); it was not imported. If you "
            "wrote this config, load it with from_dict(data, trusted=True) or set the field "
            "yourself (--set)"
        )


# Where classes that saved configs name have moved: the new `module:Qualname`, or the registry
# name of a component that is now a plugin's (resolved only where that plugin is installed).
# Runs and checkpoints written before a move keep loading.
MOVED = {
    "axplug.kernels.layer:FlashAttention": "axplug.layers.flash:FlashAttention",
    "axplug.kernels.layer:BlockwiseAttention": "axplug.layers.flash:BlockwiseAttention",
    "axplug.kernels.modifier:FlashAttentionModifier": "axplug.layers.flash:FlashAttentionModifier",
    "axplug.summary.tensorboard:TensorBoardWriter": "tensorboard",
}


def class_name(obj: Any) -> str:
    """`module:Qualname` of a class or function."""
    return f"{obj.__module__}:{obj.__qualname__}"


def _import_qualname(name: str) -> Any:
    module_name, _, qualname = name.partition(":")
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError:
        return None
    for part in qualname.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj


def resolve_class(name: str, path: str = "klass", *, trusted: bool = True) -> Any:
    """A class from `module:Qualname` or a registry name (`name`, `my-dist:name`);
    untrusted, a `module:Qualname` must lie in the core or an installed plugin package."""
    name = MOVED.get(name, name)
    if _QUALNAME.match(name):
        check_enabled_reference(name, path)
        if not trusted:
            check_trusted_reference(name, path)
        if (obj := _import_qualname(name)) is not None:
            return obj
    from axplug import registry

    for kind in _SEARCH_KINDS:
        try:
            return registry.load(kind, name)
        except LookupError:
            continue
    raise ConfigError(
        f"{path}: unknown class {name!r}: neither an importable `module:Qualname` nor a "
        f"registered component; run `axplug list` to see what is installed"
    )


def to_dict(cfg: ConfigBase) -> dict[str, Any]:
    """A JSON-compatible dict of `cfg`; `from_dict` rebuilds an equal config."""
    out: dict[str, Any] = {}
    klass = configurable_class(cfg)
    if klass is None or type(cfg) is not klass.Config:
        out["config_class"] = class_name(type(cfg))
    for key, value in cfg.items():
        out[key] = _encode(value)
    return out


def _encode(value: Any) -> Any:
    if isinstance(value, ConfigBase):
        return to_dict(value)
    if isinstance(value, (list, tuple)):
        return [_encode(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _encode(v) for k, v in value.items()}
    if isinstance(value, type) or callable(value):
        return class_name(value)
    if value is not None and not isinstance(value, (bool, int, float, str)):
        if value is REQUIRED:
            return dict(_REQUIRED_MARK)
        raise ConfigError(f"cannot serialize {type(value).__qualname__} value {value!r}")
    return value


def from_dict(data: dict[str, Any], path: str = "", *, trusted: bool = False) -> ConfigBase:
    """Rebuilds a config written by `to_dict`; unknown classes and fields fail with the path.

    `trusted=False` (the default: data read from a file or a checkpoint) resolves code only
    inside the core and the installed plugins; see the module docstring.
    """
    if not isinstance(data, dict):
        raise ConfigTypeError(f"{path or '<root>'}: expected a config dict, got {type(data)}")
    where = lambda k: f"{path}.{k}" if path else k  # noqa: E731
    if "config_class" in data:
        config_class = resolve_class(data["config_class"], where("config_class"), trusted=trusted)
        if not (isinstance(config_class, type) and issubclass(config_class, ConfigBase)):
            raise ConfigTypeError(
                f"{where('config_class')}: {data['config_class']!r} is not a config class"
            )
        cfg = config_class()
        if "klass" in data and data["klass"] is not None:
            cfg.klass = _configurable(data["klass"], where("klass"), trusted)
    elif data.get("klass") is not None:
        cfg = _configurable(data["klass"], where("klass"), trusted).default_config()
    else:
        raise ConfigError(f"{path or '<root>'}: a config dict needs 'klass' or 'config_class'")
    fields = attrs.fields_dict(type(cfg))
    types_ = _field_types(type(cfg))
    code_fields = getattr(type(cfg), "CODE_FIELDS", ())
    renamed = {key: new for key, new in type(cfg).RENAMED.items() if key in data}
    if renamed:  # saved before these fields moved: read into their new places
        moves = ", ".join(f"{old} -> {new}" for old, new in renamed.items())
        _log.warning("%s: saved before its fields moved (%s)", path or "a config", moves)
    for key, value in data.items():
        if key in ("config_class", "klass"):
            continue
        if key in renamed:
            *parents, leaf = renamed[key].split(".")
            setattr(functools.reduce(getattr, parents, cfg), leaf, value)
            continue
        if key not in fields:
            raise UnknownFieldError(f"{where(key)}: unknown field{_suggest(key, list(fields))}")
        if not trusted and key in code_fields and isinstance(value, str):
            check_trusted_reference(value, where(key))
        setattr(cfg, key, decode(value, types_.get(key, Any), where(key), trusted=trusted))
    return cfg


def _configurable(name: str, path: str, trusted: bool) -> type[Configurable]:
    klass = resolve_class(name, path, trusted=trusted)
    if not (isinstance(klass, type) and issubclass(klass, Configurable)):
        raise ConfigTypeError(f"{path}: {name!r} is not a configurable class")
    return klass


def _allows(tp: Any, kind: type) -> bool:
    origin = typing.get_origin(tp)
    if origin is typing.Union or type(tp).__name__ == "UnionType":
        return any(_allows(a, kind) for a in typing.get_args(tp))
    return origin is kind or tp is kind


def decode(value: Any, tp: Any, path: str, *, trusted: bool = False) -> Any:
    """Converts a JSON value back to the field's type (tuples, classes, configs, REQUIRED)."""
    if value == _REQUIRED_MARK:
        return REQUIRED
    if isinstance(value, dict) and ("klass" in value or "config_class" in value):
        return from_dict(value, path, trusted=trusted)
    if isinstance(value, list):
        element = _element_type(tp)
        items = [decode(v, element, f"{path}[{i}]", trusted=trusted) for i, v in enumerate(value)]
        return tuple(items) if _allows(tp, tuple) and not _allows(tp, list) else items
    if isinstance(value, dict):
        return {k: decode(v, Any, f"{path}[{k!r}]", trusted=trusted) for k, v in value.items()}
    if isinstance(value, str) and (_allows(tp, type) or _is_callable_type(tp)):
        return resolve_class(value, path, trusted=trusted)
    return value


def _element_type(tp: Any) -> Any:
    for candidate in (tp, *typing.get_args(tp)):
        if typing.get_origin(candidate) in (list, tuple):
            args = typing.get_args(candidate)
            return args[0] if args else Any
    return Any


def _is_callable_type(tp: Any) -> bool:
    origin = typing.get_origin(tp)
    if origin is typing.Union or type(tp).__name__ == "UnionType":
        return any(_is_callable_type(a) for a in typing.get_args(tp))
    return getattr(origin, "__name__", None) == "Callable"
