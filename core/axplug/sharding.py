"""The sharding scope: the mesh and logical-axis rules that layers lay out activations with.

The Trainer, `axplug aot`, the inference Engine and the conformance kit enter
`sharding_scope(mesh, rules)` inside the functions they jit, so the trace carries the layout
and never depends on state ambient at call time. Layers name the logical axes of their
activations, `constrain(x, ("batch", "seq", "act_embed"))`, as they name those of their
parameters; the rules map them to mesh axes. Outside any scope `constrain` falls back to the
mesh of `jax.set_mesh` (with the default rules), and with no mesh at all it does nothing, so
layers run unchanged on one device.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import math
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from axplug.mesh import DEFAULT_AXIS_RULES, PIPELINE_AXIS, logical_to_partition_spec

__all__ = [
    "PIPELINE_AXIS",
    "ShardingScope",
    "make_scope",
    "sharding_scope",
    "current_scope",
    "constrain",
    "mesh_axis_size",
    "scoped",
    "map_over_batch",
]


@dataclasses.dataclass(frozen=True)
class ShardingScope:
    """A mesh and the logical-to-mesh axis rules in force."""

    mesh: Mesh | jax.sharding.AbstractMesh
    rules: tuple[tuple[str, Any], ...]

    def spec(self, logical_axes: Sequence[str | None], shape=None) -> PartitionSpec:
        """The PartitionSpec of an array whose dims carry `logical_axes`."""
        return logical_to_partition_spec(tuple(logical_axes), self.rules, self.mesh, shape)

    def mesh_axes(self, logical_axis: str, size: int | None = None) -> tuple[str, ...]:
        """The mesh axes the rules split `logical_axis` over (a dim of `size`, when given,
        keeps only the axes that divide it)."""
        spec = self.spec((logical_axis,), None if size is None else (size,))[0]
        return () if spec is None else (spec,) if isinstance(spec, str) else tuple(spec)

    def axis_size(self, logical_axis: str, size: int | None = None) -> int:
        """How many ways the rules split `logical_axis` (of `size`) on this mesh."""
        return math.prod(self.mesh.shape[name] for name in self.mesh_axes(logical_axis, size))


_OFF = object()  # `sharding_scope(None)`: no constraints, and no jax.set_mesh fallback either
_SCOPE: contextvars.ContextVar[Any] = contextvars.ContextVar("axplug_sharding_scope", default=None)


def make_scope(
    mesh: Mesh | None, rules: Sequence[tuple[str, Any]] = DEFAULT_AXIS_RULES
) -> ShardingScope | None:
    """A hashable scope of `mesh` and `rules` (None without a mesh).

    Rules saved by older runs lack the activation axes: the defaults fill what they lack.
    """
    if mesh is None:
        return None
    frozen = tuple((name, tuple(axes) if isinstance(axes, list) else axes) for name, axes in rules)
    given = {name for name, _ in frozen}
    return ShardingScope(mesh, frozen + tuple(r for r in DEFAULT_AXIS_RULES if r[0] not in given))


@contextlib.contextmanager
def sharding_scope(
    mesh: Mesh | ShardingScope | None, rules: Sequence[tuple[str, Any]] = DEFAULT_AXIS_RULES
) -> Iterator[ShardingScope | None]:
    """Lays out activations over `mesh` by `rules` inside the block (None: no constraints)."""
    scope = mesh if isinstance(mesh, ShardingScope) else make_scope(mesh, rules)
    token = _SCOPE.set(_OFF if scope is None else scope)
    try:
        yield scope
    finally:
        _SCOPE.reset(token)


def scoped(fn: Callable, mesh: Mesh | ShardingScope | None, rules=DEFAULT_AXIS_RULES) -> Callable:
    """`fn` run inside `sharding_scope(mesh, rules)`: wrap a step before jitting it."""

    @functools.wraps(fn)
    def in_scope(*args: Any, **kwargs: Any) -> Any:
        with sharding_scope(mesh, rules):
            return fn(*args, **kwargs)

    return in_scope


def _in_shard_map() -> bool:
    # Inside a shard_map the arrays are one device's shards: there is nothing to lay out.
    mesh = jax.sharding.get_abstract_mesh()
    return not mesh.empty and bool(mesh.manual_axes)


def current_scope() -> ShardingScope | None:
    """The innermost scope, else one over `jax.set_mesh`'s mesh with the default rules; None
    inside `sharding_scope(None)`, inside a shard_map, or with no mesh at all."""
    scope = _SCOPE.get()
    if scope is _OFF or _in_shard_map():
        return None
    if scope is not None:
        return scope
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return None
    return ShardingScope(mesh, DEFAULT_AXIS_RULES)


def mesh_axis_size(logical_axis: str) -> int:
    """How many ways the current scope splits `logical_axis` (1 outside any scope)."""
    scope = current_scope()
    return 1 if scope is None else scope.axis_size(logical_axis)


def map_over_batch(fn: Callable, *xs: jax.Array) -> Any:
    """`fn(*xs)` run on each device's rows of `xs` (leading dim: batch) in a shard_map.

    For row-wise ops that XLA's partitioner replicates instead of splitting (e.g. `top_k`
    gathers every row onto every device). Outputs are split by rows like the inputs; where
    `current_scope()` is None or has one device it is a plain call.
    """
    scope = current_scope()
    if scope is None or scope.mesh.size == 1:
        return fn(*xs)
    rows = scope.spec(("batch",), (xs[0].shape[0],))
    if rows[0] is None:
        return fn(*xs)
    spec = PartitionSpec(rows[0])
    out = jax.eval_shape(fn, *xs)
    return jax.shard_map(
        fn,
        mesh=scope.mesh,
        in_specs=tuple(spec for _ in xs),
        out_specs=jax.tree.map(lambda _: spec, out),
        check_vma=False,
    )(*xs)


def constrain(x: jax.Array, logical_axes: Sequence[str | None]) -> jax.Array:
    """`x` constrained to the layout its logical axes have in the current scope."""
    scope = current_scope()
    if len(logical_axes) != x.ndim:
        raise ValueError(f"constrain: {len(logical_axes)} logical axes for a {x.ndim}-d array")
    if scope is None or scope.mesh.size == 1:  # one device: every layout is the same
        return x
    spec = scope.spec(logical_axes, x.shape)
    if isinstance(scope.mesh, Mesh):
        return jax.lax.with_sharding_constraint(x, NamedSharding(scope.mesh, spec))
    return jax.lax.with_sharding_constraint(x, spec)
