"""Expert parallelism by explicit all-to-all: each device sends its tokens' choices to the
devices that own their experts, runs its own experts on what it receives, and sends the
outputs back, inside one `shard_map`.

Static shapes: every device sends at most `capacity` rows to each expert shard (what the
router's capacity lets it keep for them; all its choices when drop-free), so with a capacity
the buffers, the all-to-alls and the expert work per device stay the same size as experts
and devices grow together. Drop-free, the send and receive buffers grow with the expert
shards (a ragged all-to-all, which XLA:CPU lacks, would not); the expert work does not,
since only rows that arrived run past the balanced buffer. What arrives runs drop-free on
the device's experts (`balanced_rows`). A choice past a destination's capacity is dropped
(its gate is zero) and counted in `moe/dropped_fraction`.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from axplug.api.config import ConfigError, config_class
from axplug.api.sharding import current_scope
from axplug_moe.dispatch import BalancedDispatch, Dispatch, Experts, balanced_rows
from axplug_moe.ragged import emulated_ragged_all_to_all, has_ragged_all_to_all, ragged_experts

__all__ = ["EXCHANGES", "AllToAllDispatch", "platform_of"]

EXCHANGES = ("auto", "padded", "ragged")


class AllToAllDispatch(Dispatch):
    """Tokens travel to their experts' devices by `jax.lax.all_to_all` over the mesh axes
    that split `expert` (and back), in a shard_map; without such an axis, `local` runs every
    expert in place. Summaries: `moe/dropped_fraction` (past a destination's capacity) and
    `moe/device_load` (the share of the choices each expert shard received)."""

    @config_class
    class Config(Dispatch.Config):
        # Rows a device sends each expert shard: capacity_factor x its choices / shards;
        # None: as many as the router keeps at most for the shard's experts (its capacity
        # per sequence x sequences x experts; all the choices when it is drop-free), so
        # nothing more is dropped.
        capacity_factor: float | None = None
        local: Dispatch.Config = BalancedDispatch.default_config()
        # How rows move: `padded` (static [shards, capacity] buffers), `ragged` (exact sizes
        # by ragged all-to-all, in rounds of `ragged_buffer_factor` x a device's choices;
        # drop-free; emulated where the backend lacks the op), `auto` (ragged where the
        # mesh's devices have it and nothing is capped, else padded).
        exchange: str = "auto"
        ragged_buffer_factor: float = 1.5

    def __init__(self, cfg: Config, *, parent=None):
        super().__init__(cfg, parent=parent)
        if not issubclass(cfg.local.klass or object, BalancedDispatch):
            raise cfg.field_error("local", "must be a BalancedDispatch config")
        if cfg.exchange not in EXCHANGES:
            raise cfg.field_error("exchange", f"must be one of {', '.join(EXCHANGES)}")
        self._add_child("local", cfg.local)

    def forward(self, x, routing, experts):
        scope = current_scope()
        e = experts.num_experts
        if scope is None or not (axes := scope.mesh_axes("expert", e)):
            return self.local(x, routing, experts)
        shards = scope.axis_size("expert", e)
        batch = scope.mesh_axes("batch", x.shape[0])
        if not set(axes) <= set(batch):
            raise ConfigError(
                f"{self.path}: the all-to-all needs the batch split over the expert mesh "
                f"axes {axes} (it is split over {batch or 'none'}); add them to the `batch` "
                "rule of mesh.axis_rules"
            )
        g, s, _ = x.shape
        k = routing.expert_index.shape[-1]
        groups = g // scope.axis_size("batch", g)  # per device
        choices = groups * s * k
        factor = self._config.capacity_factor
        if factor is None:  # what the router can keep for one shard's experts: no more drops
            capacity = min(choices, groups * routing.capacity * (e // shards))
        else:
            capacity = min(choices, math.ceil(factor * choices / shards))

        # Balanced routing brings each device as many choices as it sends (`choices`), so
        # the buffer takes its share of those; the rest of the (static) receive buffer
        # runs as overflow tiles only where choices arrived.
        def receiving(rows: int) -> tuple[int, int]:
            # The receiver's balanced buffer (slots per local expert) and overflow tile.
            slots = max(1, math.ceil(self.local.config.buffer_factor * rows * shards / e))
            return slots, self.local.tile(rows)

        plan = _Plan(axes, shards, capacity, *receiving(choices))
        exchange = _exchange
        platform = platform_of(scope.mesh)
        if self.exchange_for(*platform) == "ragged":
            buffer = max(1, math.ceil(self._config.ragged_buffer_factor * choices))
            slots, tile = receiving(buffer)
            emulate = not has_ragged_all_to_all(*platform)
            plan = plan._replace(slots=slots, tile=tile, buffer=buffer, emulate=emulate)
            exchange = _ragged_exchange

        def per_device(x, index, kept, gates, w_up, w_out, w_gate):
            mine = Experts(w_up, w_out, experts.activation, w_gate)
            y, sent, per_shard = exchange(x, index, kept, mine, plan)
            gates = jnp.where(sent, gates, 0.0).astype(y.dtype)
            return jnp.einsum("gskd,gsk->gsd", y.reshape(*index.shape, -1), gates), sent, per_shard

        rows = PartitionSpec(batch)
        weight = PartitionSpec(axes)
        gate = experts.wi_gate
        y, sent, per_shard = jax.shard_map(
            per_device,
            mesh=scope.mesh,
            in_specs=(rows, rows, rows, rows, weight, weight, None if gate is None else weight),
            out_specs=(rows, rows, rows),
            check_vma=False,
        )(
            x,
            routing.expert_index,
            routing.kept,
            routing.combine_weights,
            experts.wi_up,
            experts.wo,
            gate,
        )
        kept = jnp.maximum(jnp.sum(routing.kept), 1).astype(jnp.float32)
        self.add_summary("moe/dropped_fraction", 1.0 - jnp.sum(sent) / kept)
        load = jnp.sum(per_shard, axis=0).astype(jnp.float32)
        self.add_summary("moe/device_load", load / jnp.maximum(jnp.sum(load), 1.0))
        return y

    def exchange_for(self, platform: str, device_kind: str = "") -> str:
        """`padded` or `ragged`: how rows move on the mesh's devices."""
        cfg = self._config
        if cfg.exchange != "auto":
            return cfg.exchange
        ragged = has_ragged_all_to_all(platform, device_kind) and cfg.capacity_factor is None
        return "ragged" if ragged else "padded"


def platform_of(mesh) -> tuple[str, str]:
    """(platform, device kind) of the mesh's devices (`tpu` for a TPU topology compiled on a
    CPU host), else the default backend's."""
    try:
        device = mesh.devices.flat[0]
    except (AttributeError, ValueError):  # an AbstractMesh (`jax.set_mesh`) has no devices
        return jax.default_backend(), ""
    return device.platform, device.device_kind


class _Plan(NamedTuple):
    axes: tuple[str, ...]  # the mesh axes that split the experts
    shards: int  # devices along them
    capacity: int  # rows a device sends each shard
    slots: int  # the receiving side's balanced buffer per local expert
    tile: int  # its overflow tile
    buffer: int = 0  # ragged: rows a device receives a round
    emulate: bool = False  # ragged on a backend without the op: emulated_ragged_all_to_all


def _ragged_exchange(x, index, kept, experts: Experts, plan: _Plan):
    """`_exchange` by ragged all-to-all: every kept choice, at its exact size, in rounds."""
    g, s, k = index.shape
    d = x.shape[-1]
    n, m = g * s, g * s * k
    per_shard = experts.num_experts  # this device's experts
    expert = index.reshape(m)
    dest = jnp.where(kept.reshape(m), expert // per_shard, plan.shards)
    dest_sorted, order = jax.lax.sort((dest, jnp.arange(m, dtype=jnp.int32)), num_keys=1)
    send_sizes = jnp.sum(jax.nn.one_hot(dest, plan.shards, dtype=jnp.int32), axis=0)
    local = jnp.where(dest_sorted < plan.shards, expert[order] % per_shard, per_shard)
    transfer = emulated_ragged_all_to_all if plan.emulate else jax.lax.ragged_all_to_all
    y_sorted = ragged_experts(
        x.reshape(n, d)[order // k], local, send_sizes,
        (experts.wi_up, experts.wo, experts.wi_gate),
        axes=plan.axes, buffer=plan.buffer, slots=plan.slots, tile=plan.tile,
        activation=experts.activation, transfer=transfer,
    )  # fmt: skip
    y = jnp.zeros_like(y_sorted).at[order].set(y_sorted)
    return y, (dest < plan.shards).reshape(g, s, k), send_sizes.reshape(1, plan.shards)


def _exchange(x, index, kept, experts: Experts, plan: _Plan):
    """One device: (y [choices, dim], sent [g, s, k], choices sent per shard [1, shards])."""
    g, s, k = index.shape
    d = x.shape[-1]
    n, m = g * s, g * s * k
    shards, capacity = plan.shards, plan.capacity
    per_shard = experts.num_experts  # this device's experts
    expert = index.reshape(m)
    dest = jnp.where(kept.reshape(m), expert // per_shard, shards)
    # Position of each choice among this device's choices for the same destination.
    onehot = jax.nn.one_hot(dest, shards, dtype=jnp.int32)
    position = jnp.sum((jnp.cumsum(onehot, axis=0) - 1) * onehot, axis=-1)
    sent = (dest < shards) & (position < capacity)
    slot = jnp.where(sent, dest * capacity + position, shards * capacity)
    # What each send slot holds: a token row and its local expert (per_shard: nothing).
    token = jnp.full((shards * capacity + 1,), n, jnp.int32)
    token = token.at[slot].set(jnp.arange(m, dtype=jnp.int32) // k)[:-1]
    local = jnp.full((shards * capacity + 1,), per_shard, jnp.int32)
    local = local.at[slot].set(expert % per_shard)[:-1]
    rows = jnp.concatenate([x.reshape(n, d), jnp.zeros((1, d), x.dtype)])[token]

    def exchange(a):
        return jax.lax.all_to_all(a, plan.axes, 0, 0, tiled=True)

    arrived, arrived_expert = exchange(rows), exchange(local)
    ids = jnp.arange(shards * capacity, dtype=jnp.int32)
    out, _, _ = balanced_rows(arrived, arrived_expert, ids, experts, plan.slots, plan.tile)
    back = jnp.concatenate([exchange(out), jnp.zeros((1, d), x.dtype)])
    per_dest = jnp.sum(onehot * sent[:, None], axis=0).reshape(1, shards)
    return back[slot], sent.reshape(g, s, k), per_dest
