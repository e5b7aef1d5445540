"""Invocation contexts: the state, PRNG key and outputs of one pure call of a module tree."""

from __future__ import annotations

import contextlib
import threading
import zlib
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, NamedTuple

import jax

from axplug.api._errors import AxplugError

if TYPE_CHECKING:
    from axplug.module import Module

__all__ = [
    "OutputCollection",
    "InvocationContext",
    "ContextError",
    "current_context",
    "set_current_context",
    "functional",
    "add_summary",
    "add_module_output",
    "add_state_update",
    "name_hash",
    "side_input",
    "side_inputs",
]


class ContextError(AxplugError, RuntimeError):
    """A module method used outside the invocation context it needs."""

    exit_code = None  # a programming error: its traceback says where


class OutputCollection(NamedTuple):
    """Nested dicts (one level per module name) of what a call produced besides its outputs."""

    summaries: dict
    state_updates: dict
    module_outputs: dict

    @classmethod
    def empty(cls) -> OutputCollection:
        return cls({}, {}, {})

    def pruned(self) -> OutputCollection:
        """A copy without the empty dicts left by modules that recorded nothing."""
        return OutputCollection(*(_prune(branch) for branch in self))

    def add_child(self, name: str) -> OutputCollection:
        return OutputCollection(
            *(
                branch.setdefault(name, {})
                for branch in (self.summaries, self.state_updates, self.module_outputs)
            )
        )


def _prune(tree: dict) -> dict:
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            value = _prune(value)
            if not value:
                continue
        out[key] = value
    return out


def name_hash(name: str) -> int:
    """A stable 31-bit hash of a name (Python's hash() is salted per process)."""
    return zlib.crc32(name.encode()) & 0x7FFFFFFF


class InvocationContext:
    """One frame of the call stack: the module being called and what it may read and write."""

    def __init__(
        self,
        *,
        module: Module,
        state: Any,
        prng_key: jax.Array | None,
        is_training: bool,
        output_collection: OutputCollection,
        parent: InvocationContext | None = None,
    ):
        self.module = module
        self.state = state
        self._prng_key = prng_key
        # (parent, child name, call number) when this call's key derives from its parent's.
        self._key_source: tuple[InvocationContext, str, int] | None = None
        self.is_training = is_training
        self.output_collection = output_collection
        self.parent = parent
        self._child_calls: dict[str, int] = {}

    @property
    def has_prng_key(self) -> bool:
        """Whether `prng_key` is an array (functional() was given one), without deriving it."""
        if self._key_source is not None:
            return self._key_source[0].has_prng_key
        return self._prng_key is not None

    @property
    def prng_key(self) -> jax.Array | None:
        """This call's key: fold_in(fold_in(parent key, hash(name)), call number).

        Derived when read, not when the child is entered: most modules never read one, and
        the fold-ins of every module were a quarter of a small model's traced step. Not
        cached, since a read may happen under an inner trace (a remat, a custom VJP) whose
        values must not outlive it.
        """
        if self._key_source is None:
            return self._prng_key
        parent, name, call = self._key_source
        base = parent.prng_key
        if base is None:
            return None
        return jax.random.fold_in(jax.random.fold_in(base, name_hash(name)), call)

    def add_child(self, name: str) -> InvocationContext:
        """The context for one call of child `name`; its key depends on the name, not order."""
        child = self.module.children.get(name)
        if child is None:
            raise ContextError(f"{self.module.path}: has no child {name!r}")
        call = self._child_calls.get(name, 0)
        self._child_calls[name] = call + 1
        # A repeated call writes its outputs under `name#k`, so nothing is overwritten.
        collection_name = name if call == 0 else f"{name}#{call}"
        state = self.state.get(name, {}) if isinstance(self.state, dict) else {}
        context = InvocationContext(
            module=child,
            state=state,
            prng_key=None,
            is_training=self.is_training,
            output_collection=self.output_collection.add_child(collection_name),
            parent=self,
        )
        context._key_source = (self, name, call)
        return context

    def _add(self, branch: dict, kind: str, name: str, value: Any) -> None:
        if name in branch:
            raise ContextError(
                f"{self.module.path}: {kind} {name!r} was already added in this call"
            )
        branch[name] = value

    def add_summary(self, name: str, value: Any) -> None:
        self._add(self.output_collection.summaries, "summary", name, value)

    def add_module_output(self, name: str, value: Any) -> None:
        self._add(self.output_collection.module_outputs, "module output", name, value)

    def add_state_update(self, name: str, value: Any) -> None:
        self._add(self.output_collection.state_updates, "state update", name, value)


_local = threading.local()


def _stack() -> list[InvocationContext]:
    if not hasattr(_local, "stack"):
        _local.stack = []
    return _local.stack


def current_context() -> InvocationContext | None:
    """The innermost active context, or None outside `functional()`."""
    stack = _stack()
    return stack[-1] if stack else None


@contextlib.contextmanager
def set_current_context(ctx: InvocationContext) -> Iterator[InvocationContext]:
    stack = _stack()
    stack.append(ctx)
    try:
        yield ctx
    finally:
        stack.pop()


def _require_context(what: str) -> InvocationContext:
    ctx = current_context()
    if ctx is None:
        raise ContextError(
            f"{what}() needs an invocation context: call the module via functional()"
        )
    return ctx


@contextlib.contextmanager
def side_inputs(**values: Any) -> Iterator[None]:
    """Values any layer called within may read by name (`side_input`), set by the caller of a
    whole model: per-row data that no layer's signature carries (a row's adapter)."""
    previous = getattr(_local, "side", {})
    _local.side = {**previous, **values}
    try:
        yield
    finally:
        _local.side = previous


def side_input(name: str) -> Any:
    """The value `side_inputs` set for `name` around this call, else None."""
    return getattr(_local, "side", {}).get(name)


def add_summary(name: str, value: Any) -> None:
    """Records a summary (scalar, histogram source...) for the current module."""
    _require_context("add_summary").add_summary(name, value)


def add_module_output(name: str, value: Any) -> None:
    """Records an auxiliary output (e.g. an aux loss) for the current module."""
    _require_context("add_module_output").add_module_output(name, value)


def add_state_update(name: str, value: Any) -> None:
    """Records a new value for a piece of the current module's state."""
    _require_context("add_state_update").add_state_update(name, value)


def functional(
    module: Module,
    *,
    prng_key: jax.Array | None,
    state: Any,
    inputs: Any,
    is_training: bool,
    method: str = "forward",
) -> tuple[Any, OutputCollection]:
    """Calls `module.<method>(inputs)` as a pure function of (prng_key, state, inputs).

    `inputs` is a dict of keyword arguments or a sequence of positional ones. Returns the
    method's outputs and the OutputCollection of summaries, state updates and module outputs.
    """
    ctx = InvocationContext(
        module=module,
        state=state,
        prng_key=prng_key,
        is_training=is_training,
        output_collection=OutputCollection.empty(),
    )
    fn = getattr(module, method)
    with set_current_context(ctx):
        outputs = fn(**inputs) if isinstance(inputs, dict) else fn(*inputs)
    return outputs, ctx.output_collection.pruned()
