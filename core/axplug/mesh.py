"""Device meshes, logical-to-mesh axis rules, and the shardings they give parameters and batches."""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from axplug.api import ParameterSpec
from axplug.config import ConfigError, Configurable, config_class

__all__ = [
    "MESH_AXES",
    "DEFAULT_AXIS_RULES",
    "MeshBuilder",
    "logical_to_partition_spec",
    "parameter_shardings",
    "batch_partition_spec",
    "device_groups",
]

MESH_AXES = ("data", "fsdp", "expert", "seq", "model")
# The pipeline axis joins the mesh (outermost) only when a run pipelines its layers, so a
# mesh without it keeps the five-entry shape every saved config has.
PIPELINE_AXIS = "pipeline"

# Logical axis -> mesh axes it is sharded over (in order), or None for replicated.
# Parameters: embed, mlp, heads, vocab, kv (head_dim), expert, layers. Activations: `batch`
# (the leading axis of every input batch: every batch-like mesh axis), `seq` (the sequence:
# sequence parallelism), `act_embed` (the residual stream's features), `kv_seq` (keys and
# values gathered along the sequence for exact attention), and heads, mlp, vocab, expert.
DEFAULT_AXIS_RULES: tuple[tuple[str, Any], ...] = (
    ("batch", ("data", "fsdp", "expert", PIPELINE_AXIS)),
    ("embed", "fsdp"),
    ("mlp", "model"),
    ("heads", "model"),
    ("vocab", "model"),
    ("kv", None),
    ("expert", "expert"),
    ("layers", None),
    ("stage", PIPELINE_AXIS),
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
        """A Mesh over `devices` (default all), laid out by `_device_array` for the topology.

        A shape without -1 that needs fewer of one process's devices takes the first ones
        (as `mesh.mesh_shape=(1, 1, 1, 1, 1)` for a one-device run on an 8-device host)."""
        devices = list(jax.devices() if devices is None else devices)
        needed = math.prod(self._config.mesh_shape)
        if 0 < needed < len(devices) and len({d.process_index for d in devices}) == 1:
            log.info("mesh.mesh_shape %s: the first %d of %d devices", self._config.mesh_shape,
                     needed, len(devices))  # fmt: skip
            devices = devices[:needed]
        shape = self.resolved_shape(len(devices))
        names = tuple(self._config.axis_names)
        return Mesh(_device_array(devices, shape, names), names)

    @property
    def axis_rules(self) -> tuple[tuple[str, Any], ...]:
        return tuple(self._config.axis_rules)


# --- device layout ---------------------------------------------------------------------------

log = logging.getLogger("axplug.mesh")


def _device_array(devices: Sequence[Any], shape: Sequence[int], axis_names: Sequence[str]):
    """`devices` as a `shape` array: `data` across slices or hosts (DCN), other axes within one.

    A pure function of the device objects' `platform`, `process_index`, `slice_index` (TPU) and
    the attributes `jax.experimental.mesh_utils` reads (`coords`, `core_on_chip` on TPU).
    """
    shape = tuple(shape)
    if not devices or devices[0].platform == "cpu":
        # CPU devices have no topology; keep the given order (multi-process CPU runs rely on it).
        return np.asarray(devices).reshape(shape)
    groups = device_groups(devices)
    if len(groups) == 1:
        return _within_one_group(devices, shape)
    split = _hybrid_shapes(shape, axis_names, len(groups))
    if split is None:
        group = _group_noun(devices)
        log.warning(
            "mesh.mesh_shape %s: the `data` axis is not a multiple of the %d %ss the devices "
            "span, so other mesh axes cross the slow network between %ss; make `data` a "
            "multiple of %d (e.g. `mesh:fsdp=<devices per %s>,data=-1`). Using the plain "
            "device order.",
            shape,
            len(groups),
            group,
            group,
            len(groups),
            group,
        )
        return np.asarray(devices).reshape(shape)
    return _across_groups(devices, shape, *split)


def _group_noun(devices: Sequence[Any]) -> str:
    return "slice" if devices[0].platform == "tpu" else "host"


def device_groups(devices: Sequence[Any]) -> list[list[Any]]:
    """Devices grouped by TPU slice or, on other accelerators, by process (host), in key order."""
    key = "slice_index" if devices[0].platform == "tpu" else "process_index"
    groups: dict[int, list[Any]] = {}
    for device in devices:
        groups.setdefault(getattr(device, key, 0), []).append(device)
    return [groups[k] for k in sorted(groups)]


def _hybrid_shapes(
    shape: Sequence[int], axis_names: Sequence[str], num_groups: int
) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """(within-group shape, across-group shape): `data` alone spans groups; None if it cannot."""
    if "data" not in axis_names:
        return None
    i = list(axis_names).index("data")
    if shape[i] % num_groups:
        return None
    inner, outer = list(shape), [1] * len(shape)
    inner[i], outer[i] = shape[i] // num_groups, num_groups
    return tuple(inner), tuple(outer)


def _within_one_group(devices: Sequence[Any], shape: tuple[int, ...]):
    """`create_device_mesh` over one slice or host (ICI)."""

    def make(split: bool):
        return mesh_utils.create_device_mesh(shape, devices, allow_split_physical_axes=split)

    return _topology_layout(devices, shape, make)


def _across_groups(devices: Sequence[Any], shape, inner: tuple[int, ...], outer: tuple[int, ...]):
    """`create_hybrid_device_mesh`: `inner` within each slice (TPU) or process, `outer` across."""

    def make(split: bool):
        return mesh_utils.create_hybrid_device_mesh(
            inner,
            outer,
            devices,
            process_is_granule=devices[0].platform != "tpu",
            allow_split_physical_axes=split,
        )

    return _topology_layout(devices, shape, make)


def _topology_layout(devices: Sequence[Any], shape: tuple[int, ...], make):
    """`make(split)` without, then with, split physical axes (warned), else the plain order."""
    try:
        return make(False)
    except Exception:  # mesh_utils raises several types for layouts it lacks
        pass
    try:
        array = make(True)
    except Exception as exc:  # e.g. an unusual device count, uneven hosts, holes in a slice
        log.warning(
            "mesh.mesh_shape %s: no topology-aware layout of %d %s devices (%s); using the "
            "plain device order",
            shape,
            len(devices),
            devices[0].platform,
            exc,
        )
        return np.asarray(devices).reshape(shape)
    log.warning(
        "mesh.mesh_shape %s only fits the %s topology by splitting physical axes: "
        "collectives over them are slower",
        shape,
        devices[0].platform,
    )
    return array
