"""Expert-parallel layouts: the mesh a model is trained on, bound to it for the dispatch.

Layers never see the mesh, so the dispatch cannot pin its [expert, group, ...] buffers to
the `expert` mesh axis by itself. The Trainer announces its mesh through the
`on_train_start` hook (this module is registered under `axplug.hooks`); `bind_mesh` records
it against the model object, and the dispatch of that model (and only that model) then
adds sharding constraints from the Trainer's logical-axis rules. Unbound models run
unconstrained and XLA's sharding propagation decides the layout.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from typing import Any

import jax
from jax.sharding import Mesh, NamedSharding

from axplug import hookimpl
from axplug.mesh import DEFAULT_AXIS_RULES, logical_to_partition_spec

__all__ = ["bind_mesh", "unbind_mesh", "bound_mesh", "constrainer", "on_train_start"]

_BOUND: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

Constrain = Callable[[jax.Array, Sequence[str | None]], jax.Array]


def bind_mesh(
    model: Any, mesh: Mesh, axis_rules: Sequence[tuple[str, Any]] = DEFAULT_AXIS_RULES
) -> None:
    """Lay out the MoE dispatch of `model` (a root module) over `mesh` from now on."""
    _BOUND[model] = (mesh, tuple(axis_rules))


def unbind_mesh(model: Any) -> None:
    _BOUND.pop(model, None)


def _root(module: Any) -> Any:
    while getattr(module, "parent", None) is not None:
        module = module.parent
    return module


def bound_mesh(module: Any) -> tuple[Mesh, tuple] | None:
    """(mesh, axis rules) bound to the root of `module`'s tree, or None."""
    return _BOUND.get(_root(module))


def _identity(x: jax.Array, axes: Sequence[str | None]) -> jax.Array:
    return x


def constrainer(module: Any) -> Constrain:
    """`constrain(x, logical_axes)`: a sharding constraint on the bound mesh (or nothing)."""
    bound = bound_mesh(module)
    if bound is None:
        return _identity
    mesh, rules = bound

    def constrain(x: jax.Array, axes: Sequence[str | None]) -> jax.Array:
        spec = logical_to_partition_spec(tuple(axes), rules, mesh, x.shape)
        return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))

    return constrain


@hookimpl
def on_train_start(trainer: Any) -> None:
    """Binds the trainer's mesh and axis rules to its model before the first step traces."""
    bind_mesh(trainer.model, trainer.mesh, trainer.mesh_builder.axis_rules)
