"""What `registry.load` checks an entry point's object against, one check per kind.

Each check returns None when the object is what its kind declares (axplug.api._kinds), else
what is missing, in words. Base classes are looked up in `sys.modules`, never imported: an
object can only subclass a class whose module is already imported, and checking stays free
(`axplug list` imports no jax).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

__all__ = ["CHECKS", "check_kind"]


def _subclass_of(where: str, extra: Callable[[type], str | None] | None = None):
    module, _, name = where.partition(":")

    def check(obj: Any) -> str | None:
        base = getattr(sys.modules.get(module), name, None)
        if not (isinstance(obj, type) and base is not None and issubclass(obj, base)):
            return f"it must be a subclass of {module}.{name}, not {_what(obj)}"
        return extra(obj) if extra is not None else None

    return check


def _instance_of(where: str):
    module, _, name = where.partition(":")

    def check(obj: Any) -> str | None:
        cls = getattr(sys.modules.get(module), name, None)
        if cls is None or not isinstance(obj, cls):
            return f"it must be an instance of {module}.{name}, not {_what(obj)}"
        return None

    return check


def _protocol(protocol: str, *names: str):
    """Each of `names` is a member (a method; a `str` for those in `_STRINGS`) of the object
    or, for a class (built with no arguments when used), of its instances."""

    def check(obj: Any) -> str | None:
        missing = [n for n in names if not _has(obj, n)]
        if missing:
            return f"it has no {', '.join(missing)} of axplug.api.{protocol} ({_what(obj)})"
        return None

    return check


def _has(obj: Any, name: str) -> bool:
    if name in _STRINGS:
        return isinstance(getattr(obj, name, None), str)
    if isinstance(obj, type):  # a class: its instances' method, not type.__call__
        return any(callable(vars(k).get(name)) for k in obj.__mro__[:-1])
    return callable(getattr(obj, name, None))


_STRINGS = ("layer", "architecture", "model_type")


def _what(obj: Any) -> str:
    if isinstance(obj, type):
        return f"the class {obj.__module__}.{obj.__qualname__}"
    return f"a {type(obj).__module__}.{type(obj).__qualname__}"


def _command(obj: Any) -> str | None:
    if not callable(getattr(obj, "add_parser", None)):
        return (
            "the module has no add_parser(subparsers) of the axplug.api._kinds.CommandModule "
            "protocol; a command module must define one"
        )
    return None


def _mesh_rule(obj: Any) -> str | None:
    if isinstance(obj, type) or not callable(obj):
        return f"it must be a function returning a MeshRule.Config, not {_what(obj)}"
    return None


def _data_source(obj: Any) -> str | None:
    if isinstance(obj, type) or not callable(obj):
        return (
            "it must be a function documents(spec: str, *, field: str) returning an iterator "
            f"of documents (str, or dict for the field '*'), not {_what(obj)}"
        )
    return None


def _factory(signature: str, returns: str, positional: int):
    """A function (not a class) taking at least `positional` positional arguments."""

    def check(obj: Any) -> str | None:
        if isinstance(obj, type) or not callable(obj):
            return f"it must be a function {signature} returning {returns}, not {_what(obj)}"
        code = getattr(obj, "__code__", None)  # a plain function: count its parameters
        has_varargs = code is not None and code.co_flags & 0x04  # CO_VARARGS
        if code is not None and not has_varargs and code.co_argcount < positional:
            return (
                f"{obj.__module__}.{obj.__qualname__} takes {code.co_argcount} positional "
                f"arguments; it must be {signature}"
            )
        return None

    return check


CHECKS: dict[str, Callable[[Any], str | None]] = {
    "layers": _subclass_of("axplug.layers.base:BaseLayer"),
    "modifiers": _subclass_of("axplug.config.tree:ConfigModifier"),
    "kernels": _protocol("Kernel", "is_supported", "__call__"),
    "mesh_rules": _mesh_rule,
    "storage": _subclass_of("axplug.checkpoint.storage:Storage"),
    "presets": _instance_of("axplug.presets:Preset"),
    "inputs": _subclass_of("axplug.input.base:Input"),
    "summary_writers": _subclass_of("axplug.summary.base:SummaryWriter"),
    "architectures": _protocol(
        "HFArchitecture", "architecture", "model_type", "base_config", "tensors"
    ),
    "commands": _command,
    "data_sources": _data_source,
    "optimizers": _factory(
        "make(learning_rate, cfg, *, weight_decay_mask=None, **options)",
        "an optax.GradientTransformation",
        2,
    ),
    "schedules": _factory("make(peak, steps, cfg, **options)", "an optax.Schedule", 3),
    "rewards": _protocol("Reward", "score", "score_batch"),
    "proposers": _subclass_of("axplug.inference.speculation:Proposer"),
    "guides": _subclass_of("axplug.inference.constraints:Guide"),
    "tool_parsers": _protocol("ToolCallFormat", "parse", "grammar"),
    # hooks: pluggy validates each implementation against the hookspecs when registering.
}


def check_kind(kind: str, obj: Any) -> str | None:
    """None when `obj` is what an entry point of `kind` must load, else what is missing."""
    check = CHECKS.get(kind)
    return None if check is None else check(obj)
