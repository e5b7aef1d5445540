"""Device meshes, logical-to-mesh axis rules, and the shardings they give parameters and batches."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from axplug.config import ConfigError, Configurable, config_class
from axplug.layers.base import ParameterSpec

__all__ = [
    "MESH_AXES",
    "DEFAULT_AXIS_RULES",
    "MeshBuilder",
    "logical_to_partition_spec",
    "parameter_shardings",
    "batch_partition_spec",
]

MESH_AXES = ("data", "fsdp", "expert", "seq", "model")

# Logical axis -> mesh axes it is sharded over (in order), or None for replicated.
# Parameters: embed, mlp, heads, vocab, kv (head_dim), expert, layers. Activations: `batch`
# (the leading axis of every input batch: every batch-like mesh axis), `seq` (the sequence:
# sequence parallelism), `act_embed` (the residual stream's features), `kv_seq` (keys and
# values gathered along the sequence for exact attention), and heads, mlp, vocab, expert.
DEFAULT_AXIS_RULES: tuple[tuple[str, Any], ...] = (
    ("batch", ("data", "fsdp", "expert")),
    ("embed", "fsdp"),
    ("mlp", "model"),
    ("heads", "model"),
    ("vocab", "model"),
    ("kv", None),
    ("expert", "expert"),
    ("layers", None),
    ("seq", "seq"),
    ("act_embed", None),
    ("kv_seq", None),
)


def _as_tuple(mesh_axes: Any) -> tuple[str, ...]:
    if mesh_axes is None:
        return ()
    return (mesh_axes,) if isinstance(mesh_axes, str) else tuple(mesh_axes)


def logical_to_partition_spec(
    logical_axes: Sequence[str | None],
    rules: Sequence[tuple[str, Any]],
    mesh: Mesh,
    shape: Sequence[int] | None = None,
) -> PartitionSpec:
    """The PartitionSpec for an array whose dims carry `logical_axes`.

    A mesh axis is used at most once per array (first dim wins) and only where it divides
    the dim, so a rule never produces an invalid sharding; size-1 mesh axes are dropped.
    """
    table = dict(rules)
    used: set[str] = set()
    spec = []
    for i, logical in enumerate(logical_axes):
        if logical is not None and logical not in table:
            raise ConfigError(
                f"logical axis {logical!r} has no mesh rule; known logical axes: {sorted(table)}"
            )
        chosen = []
        size = 1
        for axis in _as_tuple(table.get(logical)):
            if axis in used or mesh.shape.get(axis, 1) == 1:
                continue
            if shape is not None and shape[i] % (size * mesh.shape[axis]):
                continue
            chosen.append(axis)
            size *= mesh.shape[axis]
        used.update(chosen)
        spec.append(None if not chosen else chosen[0] if len(chosen) == 1 else tuple(chosen))
    return PartitionSpec(*spec)


def parameter_shardings(specs: Any, mesh: Mesh, rules: Sequence[tuple[str, Any]]) -> Any:
    """A tree of NamedShardings for a tree of ParameterSpecs."""
    return jax.tree.map(
        lambda s: NamedSharding(mesh, logical_to_partition_spec(s.mesh_axes, rules, mesh, s.shape)),
        specs,
        is_leaf=lambda s: isinstance(s, ParameterSpec),
    )


def batch_partition_spec(mesh: Mesh, rules: Sequence[tuple[str, Any]], ndim: int = 2):
    """PartitionSpec of a [batch, ...] input: the batch axis over the rule's data axes."""
    return logical_to_partition_spec(("batch",) + (None,) * (ndim - 1), rules, mesh)


class MeshBuilder(Configurable):
    """Builds a Mesh of `mesh_shape` over `axis_names`; one -1 entry takes the remaining devices."""

    @config_class
    class Config(Configurable.Config):
        mesh_shape: tuple[int, ...] = (-1, 1, 1, 1, 1)
        axis_names: tuple[str, ...] = MESH_AXES
        axis_rules: tuple[tuple[str, Any], ...] = DEFAULT_AXIS_RULES

    def resolved_shape(self, num_devices: int) -> tuple[int, ...]:
        """`mesh_shape` with -1 filled in; errors say which device count was expected."""
        cfg = self._config
        shape = list(cfg.mesh_shape)
        if len(shape) != len(cfg.axis_names):
            raise ConfigError(
                f"mesh.mesh_shape {tuple(shape)} needs one entry per axis of {cfg.axis_names}"
            )
        if shape.count(-1) > 1:
            raise ConfigError(f"mesh.mesh_shape {tuple(shape)}: at most one -1 entry")
        known = math.prod(d for d in shape if d != -1)
        if -1 in shape:
            if num_devices % known:
                raise ConfigError(
                    f"mesh.mesh_shape {tuple(shape)}: {num_devices} devices are not divisible "
                    f"by the fixed axes' product {known}"
                )
            shape[shape.index(-1)] = num_devices // known
        if math.prod(shape) != num_devices:
            raise ConfigError(
                f"mesh.mesh_shape {tuple(shape)} needs {math.prod(shape)} devices but "
                f"{num_devices} are available; use -1 for one axis to absorb the rest"
            )
        return tuple(shape)

    def build(self, devices: Sequence[jax.Device] | None = None) -> Mesh:
        devices = list(jax.devices() if devices is None else devices)
        shape = self.resolved_shape(len(devices))
        return Mesh(np.asarray(devices).reshape(shape), tuple(self._config.axis_names))

    @property
    def axis_rules(self) -> tuple[tuple[str, Any], ...]:
        return tuple(self._config.axis_rules)
