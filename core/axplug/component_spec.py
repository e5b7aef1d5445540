"""Component specs on the command line: `NAME[:key=value,...]` -> a configured component."""

from __future__ import annotations

import re

from axplug.config import ConfigError, InstantiableConfig, parse_value

__all__ = ["parse_spec", "resolve_spec", "component_config"]

_KWARG_SPLIT = re.compile(r",(?=\s*[A-Za-z_]\w*\s*=)")


def parse_spec(spec: str, what: str = "modifier") -> tuple[str, dict]:
    """`name:size=8,top_k=2` -> ("name", {...}); `my-dist:name` keeps its qualifier."""
    spec = spec.strip()
    eq = spec.find("=")
    if eq < 0:
        return spec, {}
    colon = spec.rfind(":", 0, eq)
    if colon < 0:
        raise ConfigError(f"{what} {spec!r}: expected NAME or NAME:key=value,...")
    kwargs = {}
    for item in _KWARG_SPLIT.split(spec[colon + 1 :]):
        key, _, text = item.partition("=")
        if key.strip() in kwargs:
            raise ConfigError(f"{what} {spec!r}: {key.strip()!r} is given twice")
        kwargs[key.strip()] = parse_value(text)
    return spec[:colon], kwargs


def resolve_spec(kind: str, spec: str, what: str) -> tuple[str, dict]:
    """`parse_spec`, plus `NAME:VALUE` for a registered component that declares a
    `positional_option` (`name:value` sets that field); `dist:NAME` otherwise."""
    from axplug import registry

    name, kwargs = parse_spec(spec, what)
    head, _, tail = name.rpartition(":")
    if head and not kwargs and head in registry.names(kind) and name not in registry.names(kind):
        positional = getattr(registry.load(kind, head), "positional_option", None)
        if positional is not None:
            return head, {positional: parse_value(tail)}
    return name, kwargs


def component_config(kind: str, spec: str, what: str) -> InstantiableConfig:
    """The default config of the registered `kind` component named by `spec`, with its
    key=value pairs set (unknown keys and bad values name the component)."""
    from axplug import registry

    name, kwargs = resolve_spec(kind, spec, what)
    try:
        cls = registry.load(kind, name)
    except registry.ComponentNotFoundError:
        head, _, tail = name.rpartition(":")
        if head and not kwargs and head in registry.names(kind):
            # `name:key`: a key without a value, not a distribution-qualified name.
            raise ConfigError(
                f"{what} {spec!r}: expected key=value after {head + ':'!r}, e.g. "
                f"{head}:{tail}=VALUE"
            ) from None
        raise
    cfg = cls.default_config()
    for key, value in kwargs.items():
        try:
            if isinstance(value, list) and isinstance(getattr(cfg, key, None), tuple):
                value = tuple(value)
            setattr(cfg, key, value)
        except ConfigError as e:
            raise type(e)(f"{what} {name!r}: {e}") from None
    return cfg
