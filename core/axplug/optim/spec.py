"""`learner.optimizer` / `learner.schedule` specs -> a registered factory and checked options."""

from __future__ import annotations

import types
import typing
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Literal, NamedTuple

from axplug.config import ConfigDependencyError, ConfigError
from axplug.optim.contract import RESERVED

if TYPE_CHECKING:
    import optax

    from axplug.learner import Learner

__all__ = [
    "CORE_OPTIMIZERS",
    "CORE_SCHEDULES",
    "ComponentSpec",
    "resolve",
    "build_optimizer",
    "build_schedule",
]

# What the core registers (the root pyproject.toml); `axplug list --kind optimizers` lists all.
CORE_OPTIMIZERS = ("adamw", "adam", "sgd")
CORE_SCHEDULES = ("constant", "cosine", "linear")

_FIELDS = {"optimizers": "optimizer", "schedules": "schedule"}
# Leading positional arguments the Learner passes: (learning_rate, cfg), (peak, steps, cfg).
_POSITIONAL = {"optimizers": 2, "schedules": 3}
_OPTION_KINDS = ("POSITIONAL_OR_KEYWORD", "KEYWORD_ONLY")


class ComponentSpec(NamedTuple):
    """A resolved spec: the registered factory and the options to call it with."""

    name: str
    factory: Callable[..., Any]
    options: dict[str, Any]
    takes_mask: bool  # the factory declares `weight_decay_mask` (or **options)


def located(cfg: Learner.Config) -> Learner.Config:
    """`cfg`, or a copy named `learner` when it is a tree's root: errors always name
    `learner.optimizer` / `learner.schedule`."""
    return cfg if cfg.field_path() != type(cfg).__qualname__ else cfg.located("learner")


def resolve(kind: str, cfg: Learner.Config) -> ComponentSpec:
    """The `kind` ("optimizers" or "schedules") factory `cfg` names, with its checked options;
    a ConfigError naming the field otherwise."""
    field = _FIELDS[kind]
    cfg = located(cfg)
    spec = getattr(cfg, field)
    if not isinstance(spec, str) or not spec.strip():
        raise cfg.field_error(field, f"expected NAME or NAME:key=value,..., got {spec!r}")
    from axplug.component_spec import parse_spec

    try:
        name, options = parse_spec(spec, "spec")
    except ConfigError as e:
        raise cfg.field_error(field, str(e)) from None
    factory = _load(kind, cfg, field, name)
    params, open_ended = _parameters(kind, factory)
    for key in options:
        if key in RESERVED[kind]:
            raise cfg.field_error(field, f"{name}: {key!r} is set by the learner, not an option")
        if not open_ended and key not in params:
            raise cfg.field_error(field, _unknown_option(cfg, kind, name, key, list(params)))
    for key, value in options.items():
        hint = _hint(factory, params[key]) if key in params else None
        if hint is not None and _matches(value, hint) is False:
            raise cfg.field_error(
                field, f"{name}: option {key}={value!r} must be {_describe(hint)}"
            )
    takes_mask = open_ended or "weight_decay_mask" in params
    return ComponentSpec(name, factory, options, takes_mask)


def build_optimizer(
    cfg: Learner.Config, learning_rate: optax.Schedule, weight_decay_mask: Any
) -> optax.GradientTransformation:
    """The optimizer `cfg.optimizer` names, called as its contract says (axplug.optim)."""
    spec = resolve("optimizers", cfg)
    cfg = located(cfg)
    kwargs = dict(spec.options)
    if spec.takes_mask:
        kwargs["weight_decay_mask"] = weight_decay_mask
    tx = _call(cfg, "optimizer", spec, lambda: spec.factory(learning_rate, cfg, **kwargs))
    if not (callable(getattr(tx, "init", None)) and callable(getattr(tx, "update", None))):
        raise cfg.field_error(
            "optimizer",
            f"{spec.name!r} returned {type(tx).__qualname__}, not an "
            "optax.GradientTransformation (a plugin bug: see docs/plugin-reference.md)",
        )
    return tx


def build_schedule(cfg: Learner.Config, peak: float, steps: int) -> optax.Schedule:
    """The after-warmup schedule `cfg.schedule` names, over `steps` steps from `peak`."""
    spec = resolve("schedules", cfg)
    cfg = located(cfg)
    schedule = _call(cfg, "schedule", spec, lambda: spec.factory(peak, steps, cfg, **spec.options))
    if not callable(schedule):
        raise cfg.field_error(
            "schedule",
            f"{spec.name!r} returned {type(schedule).__qualname__}, not an optax.Schedule "
            "(a function of the step; a plugin bug: see docs/plugin-reference.md)",
        )
    return schedule


def _call(cfg: Learner.Config, field: str, spec: ComponentSpec, make: Callable[[], Any]) -> Any:
    try:
        return make()
    except ConfigError:
        raise
    except (ValueError, TypeError) as e:  # optax refusing a value: the user's option
        raise cfg.field_error(field, f"{_spec_text(spec)}: {e}") from e


def _spec_text(spec: ComponentSpec) -> str:
    options = ",".join(f"{k}={v!r}" for k, v in spec.options.items())
    return f"{spec.name}:{options}" if options else spec.name


def _load(kind: str, cfg: Learner.Config, field: str, name: str) -> Callable[..., Any]:
    from axplug import registry

    try:
        return registry.load(kind, name)
    except registry.ComponentUnavailableError as e:
        raise cfg.field_error(field, str(e)) from None
    except registry.ComponentNotFoundError:
        import difflib

        available = registry.names(kind)
        close = difflib.get_close_matches(name, available, n=3)
        hint = f" (did you mean {' or '.join(map(repr, close))}?)" if close else ""
        listing = ", ".join(available) if available else "none installed"
        raise cfg.field_error(
            field,
            f"unknown {name!r}{hint}; choose from {listing} (`axplug list --kind {kind}`; "
            f"docs/plugin-reference.md names the first-party plugins with more {kind})",
        ) from None
    except registry.ComponentConflictError as e:
        raise cfg.field_error(field, str(e)) from None
    except registry.PluginLoadError as e:
        raise cfg.field_error(field, str(e), ConfigDependencyError) from None


def _parameters(kind: str, factory: Callable[..., Any]) -> tuple[dict[str, Any], bool]:
    """The factory's options (name -> inspect.Parameter, the reserved ones included) and
    whether it takes any keyword (**options)."""
    import inspect

    try:
        signature = inspect.signature(factory)
    except (TypeError, ValueError):  # a builtin without a signature: cannot check
        return {}, True
    params = list(signature.parameters.values())
    positional = [p for p in params if p.kind.name in ("POSITIONAL_ONLY", "POSITIONAL_OR_KEYWORD")]
    skipped = {p.name for p in positional[: _POSITIONAL[kind]]}
    options = {p.name: p for p in params if p.kind.name in _OPTION_KINDS and p.name not in skipped}
    open_ended = any(p.kind is p.VAR_KEYWORD for p in params)
    return options, open_ended


def _unknown_option(cfg: Learner.Config, kind: str, name: str, key: str, params: list[str]) -> str:
    import difflib

    allowed = [p for p in params if p not in RESERVED[kind]]
    if not allowed:
        problem = f"{name!r} takes no options, got {key!r}"
    else:
        close = difflib.get_close_matches(key, allowed, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        problem = f"{name!r} has no option {key!r}{hint}; its options: {', '.join(allowed)}"
    if hasattr(type(cfg), "__attrs_attrs__") and key in {f.name for f in type(cfg).__attrs_attrs__}:
        problem += f" ({key} is a learner field: --set {cfg.field_path(key)}=...)"
    return problem


def _hint(factory: Callable[..., Any], param: Any) -> Any:
    """The option's annotation, evaluated where it is a string (`from __future__ import
    annotations`); None where there is none or it does not resolve (left unchecked)."""
    hint = param.annotation
    if hint is param.empty:
        return None
    if isinstance(hint, str):
        try:
            hint = eval(hint, dict(getattr(factory, "__globals__", {})))  # noqa: S307
        except Exception:  # noqa: BLE001 - a name only imported for type checking
            return None
    return hint


def _matches(value: Any, hint: Any) -> bool | None:
    """Whether `value` has the annotated type; None where the hint is beyond this check."""
    origin = typing.get_origin(hint)
    if origin is Literal:
        return value in typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        answers = [_matches(value, arg) for arg in typing.get_args(hint)]
        return True if True in answers else (None if None in answers else False)
    if hint is type(None):
        return value is None
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, int | float) and not isinstance(value, bool)
    if hint is str:
        return isinstance(value, str)
    return None


def _describe(hint: Any) -> str:
    origin = typing.get_origin(hint)
    if origin is Literal:
        return "one of " + ", ".join(map(repr, typing.get_args(hint)))
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_describe(arg) for arg in typing.get_args(hint))
    if hint is type(None):
        return "None"
    return f"a {getattr(hint, '__name__', str(hint))}"
