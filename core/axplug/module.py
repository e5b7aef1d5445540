"""Modules: a tree of configured objects whose public methods run in invocation contexts."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

import jax

from axplug.config import ConfigError, Configurable, InstantiableConfig, config_class
from axplug.context import (
    ContextError,
    InvocationContext,
    current_context,
    set_current_context,
)

__all__ = ["Module", "child_context"]

# Methods every module has that must run without pushing a child context.
_UNWRAPPED = frozenset(
    {
        "default_config",
        "config",
        "create_parameter_specs_recursively",
        "initialize_parameters_recursively",
        "parameter_keys",
        "initialize_parameters",
    }
)


def child_context(module: Module) -> InvocationContext | None:
    """The context in which `module` runs now, pushing child frames from the current one."""
    ctx = current_context()
    if ctx is None or ctx.module is module:
        return ctx
    for name in _chain(module, ctx):
        ctx = ctx.add_child(name)
    return ctx


def _chain(module: Module, ctx: InvocationContext) -> list[str]:
    """The names from `ctx`'s module (exclusive) down to `module` (inclusive)."""
    chain = []
    node: Module | None = module
    while node is not None and node is not ctx.module:
        chain.append(node.name)
        node = node.parent
    if node is None:
        raise ContextError(
            f"{module.path} was called from {ctx.module.path}, which is not one of its "
            "ancestors; call it from its parent or through functional()"
        )
    return chain[::-1]


def _wrap(method: Callable) -> Callable:
    @functools.wraps(method)
    def in_child_context(self: Module, *args: Any, **kwargs: Any) -> Any:
        ctx = current_context()
        if ctx is None or ctx.module is self:
            return method(self, *args, **kwargs)
        names = _chain(self, ctx)
        for name in names:
            ctx = ctx.add_child(name)
        # The child's path (relative to the caller) names the ops it traces: HLO op metadata
        # and profiler traces read `.../decoder/transformer/layer0/attention/dot_general`.
        # A named scope is only a name: no ops, no effect on numerics or compiled code.
        with set_current_context(ctx), jax.named_scope("/".join(names)):
            return method(self, *args, **kwargs)

    in_child_context.__runs_in_child_context__ = True
    return in_child_context


class Module(Configurable):
    """A node of the module tree: children from configs, methods run in their own context."""

    @config_class
    class Config(Configurable.Config):
        name: str | None = None

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        for attr, value in list(vars(cls).items()):
            if (
                attr.startswith("_")
                or attr in _UNWRAPPED
                or not inspect.isfunction(value)
                or getattr(value, "__runs_in_child_context__", False)
            ):
                continue
            setattr(cls, attr, _wrap(value))

    def __init__(self, cfg: Module.Config, *, parent: Module | None = None):
        super().__init__(cfg)
        self._parent = parent
        self._name = cfg.name or ("model" if parent is None else None)
        if self._name is None:
            raise ConfigError(f"{type(self).__qualname__}: a child module needs a name")
        self._children: dict[str, Module] = {}

    @property
    def name(self) -> str:
        return self._name

    @property
    def parent(self) -> Module | None:
        return self._parent

    @property
    def path(self) -> str:
        """Dotted path from the root module, e.g. `model.decoder.layer0.attention`."""
        return self._name if self._parent is None else f"{self._parent.path}.{self._name}"

    @property
    def children(self) -> dict[str, Module]:
        return dict(self._children)

    def _add_child(self, name: str, cfg: InstantiableConfig, **kwargs: Any) -> Module:
        """Instantiates `cfg` as child `name`; errors name the child's dotted path."""
        if name in self._children:
            raise ConfigError(f"{self.path}: child {name!r} is already defined")
        if not name.isidentifier():
            raise ConfigError(f"{self.path}: child name {name!r} is not an identifier")
        cfg = cfg.clone(name=name)
        child = cfg.instantiate(parent=self, _path=f"{self.path}.{name}", **kwargs)
        self._children[name] = child
        return child

    def __getattr__(self, name: str) -> Module:
        children = self.__dict__.get("_children", {})
        if name in children:
            return children[name]
        raise AttributeError(
            f"{type(self).__qualname__} ({self.__dict__.get('_name')}) has no "
            f"attribute or child {name!r}"
        )

    def _context(self) -> InvocationContext:
        ctx = current_context()
        if ctx is None or ctx.module is not self:
            raise ContextError(
                f"{self.path}: state, keys and outputs are only available inside one of its "
                "methods called through functional()"
            )
        return ctx

    @property
    def state(self) -> Any:
        """This module's state (its parameters and its children's) in the current call."""
        return self._context().state

    @property
    def parameters(self) -> Any:
        return self._context().state

    @property
    def prng_key(self) -> jax.Array:
        key = self._context().prng_key
        if key is None:
            raise ContextError(f"{self.path}: needs a prng_key but functional() was given None")
        return key

    @property
    def is_training(self) -> bool:
        return self._context().is_training

    def add_summary(self, name: str, value: Any) -> None:
        self._context().add_summary(name, value)

    def add_module_output(self, name: str, value: Any) -> None:
        self._context().add_module_output(name, value)

    def add_state_update(self, name: str, value: Any) -> None:
        self._context().add_state_update(name, value)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.forward(*args, **kwargs)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(f"{type(self).__qualname__}.forward")
