"""`ParameterSpec`: what a layer declares about each parameter it owns."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax

__all__ = ["PARAMETER_UPDATES", "Initializer", "ParameterSpec"]

# `initializer(prng_key, shape, dtype) -> array`: every `jax.nn.initializers.*` fits
# (ones, zeros, constant(v), normal(stddev), variance_scaling(...)).
Initializer = Callable[[jax.Array, tuple[int, ...], Any], jax.Array]


PARAMETER_UPDATES = ("optimizer", "state", "gradient")


@dataclasses.dataclass(frozen=True)
class ParameterSpec:
    """Shape, dtype, logical mesh axes and initializer of one parameter.

    `mesh_axes` names a logical axis per dimension (`embed`, `mlp`, `heads`, `kv`, `vocab`,
    `expert`, `layers`) or None; the mesh's axis rules map logical axes to mesh axes.
    `weight_decay_scale` multiplies the learner's weight decay (0 for norms and biases).
    `update` says how the trainer changes it: `optimizer` (trained), `state` (non-trainable:
    replaced by the value the layer records with `add_state_update`, else kept: e.g. fp8
    amax histories) or `gradient` (non-trainable: replaced by its gradient, which a custom
    VJP computes as the new value, for state only the backward pass knows).
    """

    shape: tuple[int, ...]
    dtype: Any
    mesh_axes: tuple[str | None, ...]
    initializer: Initializer
    weight_decay_scale: float = 1.0
    update: str = "optimizer"

    def __post_init__(self):
        if self.update not in PARAMETER_UPDATES:
            raise ValueError(
                f"ParameterSpec: update {self.update!r} is not one of {PARAMETER_UPDATES}"
            )
        if len(self.mesh_axes) != len(self.shape):
            raise ValueError(
                f"ParameterSpec: mesh_axes {self.mesh_axes} must name one axis per dim of "
                f"shape {self.shape}"
            )
