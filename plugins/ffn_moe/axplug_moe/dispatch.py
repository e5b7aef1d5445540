"""Dispatch: send routed tokens to their experts and combine the results.

Every dispatch computes, for each token, sum_k combine_weight[k] * expert_{index[k]}(x)
over the choices the router kept; they differ only in how the work is laid out:

- `einsum` (GShard): one-hot [token, expert, slot] dispatch and combine einsums. Executes
  capacity x the model's expert FLOPs plus two one-hot einsums quadratic in the group size.
  Expert parallel (all-to-all).
- `gather`: tokens gathered into [expert, group, slot] buffers by slot index, outputs
  gathered back per choice. Executes capacity x the model's expert FLOPs. Expert parallel.
- `balanced`: drop-free; choices sorted by expert, half an even share per expert run as one
  batched matmul, the busier experts' overflow in tiles that read the weights in place.
  Executes about the model's expert FLOPs with no weight copies; no expert-parallel layout.
- `ragged`: choices sorted by expert, a grouped matmul (`axplug.kernels.grouped_matmul`: a
  hardware plugin's kernel, e.g. megablox on TPU, else `jax.lax.ragged_dot`). The model's
  FLOPs on GPU/TPU; XLA:CPU lowers it to a dense dot over every expert. No expert-parallel
  layout.
- `alltoall` (axplug_moe.alltoall): expert parallel by explicit all-to-all in a shard_map.
- `auto` (axplug_moe.dispatchers): drop-free: `alltoall` over an expert mesh axis, else
  `ragged` on GPU/TPU, `balanced` elsewhere; with a capacity: `gather`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp

from axplug.api.config import ConfigError, config_class
from axplug.api.kernels import grouped_matmul
from axplug.api.layers import BaseLayer
from axplug.api.sharding import constrain
from axplug_moe.overflow import overflow_ffn, overflow_tiles
from axplug_moe.router import Routing

_TILE = 128  # rows per overflow tile (balanced), unless configured

__all__ = [
    "Experts",
    "Dispatch",
    "EinsumDispatch",
    "GatherDispatch",
    "RaggedDispatch",
    "BalancedDispatch",
    "balanced_rows",
]

# Logical axes of the expert buffers: experts over the `expert` mesh axis, groups over the
# remaining batch axes (the all-to-all happens where a buffer changes between the two).
_BY_GROUP = ("batch", None, None, None)  # [group, expert, slot, dim]
_BY_EXPERT = ("expert", "batch", None, None)  # [expert, group, slot, dim]
_HIDDEN = ("expert", "batch", None, "mlp")  # [expert, group, slot, hidden]


@dataclasses.dataclass(frozen=True)
class Experts:
    """The experts' weights (in compute dtype) and their feed-forward function."""

    wi_up: jax.Array  # [experts, dim, hidden]
    wo: jax.Array  # [experts, hidden, dim]
    activation: Callable[[jax.Array], jax.Array]
    wi_gate: jax.Array | None = None  # [experts, dim, hidden]; None: not gated

    @property
    def num_experts(self) -> int:
        return self.wi_up.shape[0]

    def __call__(self, x: jax.Array) -> jax.Array:
        """[experts, groups, slots, dim] -> same shape; expert e runs on x[e]."""
        c = constrain
        x = c(x, _BY_EXPERT)
        h = c(jnp.einsum("egcd,edh->egch", x, self.wi_up), _HIDDEN)
        if self.wi_gate is not None:
            gate = c(jnp.einsum("egcd,edh->egch", x, self.wi_gate), _HIDDEN)
            h = self.activation(gate) * h
        else:
            h = self.activation(h)
        return c(jnp.einsum("egch,ehd->egcd", h, self.wo), _BY_EXPERT)

    def ragged(self, x: jax.Array, group_sizes: jax.Array) -> jax.Array:
        """[rows, dim] sorted by expert, group_sizes[e] rows each -> [rows, dim], by the
        dispatched grouped matmul kernel (`axplug.kernels.grouped_matmul`)."""
        h = grouped_matmul(x, self.wi_up, group_sizes)
        if self.wi_gate is not None:
            h = self.activation(grouped_matmul(x, self.wi_gate, group_sizes)) * h
        else:
            h = self.activation(h)
        return grouped_matmul(h, self.wo, group_sizes)


class Dispatch(BaseLayer):
    """`forward(x [groups, group_size, dim], routing, experts) -> [groups, group_size, dim]`."""

    def forward(self, x: jax.Array, routing: Routing, experts: Experts) -> jax.Array:
        raise NotImplementedError(type(self).__qualname__)


def _combine(y: jax.Array, routing: Routing) -> jax.Array:
    # y: [g, s, k, d] expert output of each choice -> [g, s, d]
    return jnp.einsum("gskd,gsk->gsd", y, routing.combine_weights.astype(y.dtype))


class EinsumDispatch(Dispatch):
    """GShard: one-hot dispatch and combine tensors [group, token, expert, slot], einsums."""

    def forward(self, x, routing, experts):
        dtype = x.dtype
        e, c = experts.num_experts, routing.capacity
        by_expert = jax.nn.one_hot(routing.expert_index, e, dtype=dtype)  # [g, s, k, e]
        # A dropped choice gets slot c, which one_hot maps to an all-zero row.
        slot = jnp.where(routing.kept, routing.position, c)
        by_slot = jax.nn.one_hot(slot, c, dtype=dtype)  # [g, s, k, c]
        # 0/1 masks in the compute dtype are exact (and bf16 x bf16 -> f32 einsums can fail
        # to run on XLA:CPU).
        dispatch = jnp.einsum("gske,gskc->gsec", by_expert, by_slot)
        combine = jnp.einsum(
            "gske,gskc,gsk->gsec", by_expert, by_slot, routing.combine_weights.astype(dtype)
        )
        expert_in = jnp.einsum("gsec,gsd->egcd", dispatch, x)
        expert_out = experts(expert_in)
        return jnp.einsum("gsec,egcd->gsd", combine, expert_out)


class GatherDispatch(Dispatch):
    """Capacity-bounded gather: each expert slot gathers its token, each choice gathers its
    slot's output. Executes capacity_factor x the model's expert FLOPs and no one-hot
    einsums; gathers transpose to scatter-adds in the backward pass."""

    def forward(self, x, routing, experts):
        g, s, d = x.shape
        e, c = experts.num_experts, routing.capacity
        k = routing.expert_index.shape[-1]
        # Flat slot of every choice; dropped choices go to a spare slot e * c.
        slot = jnp.where(routing.kept, routing.expert_index * c + routing.position, e * c)
        slot = slot.reshape(g, s * k)
        token = jnp.broadcast_to(jnp.arange(s * k, dtype=jnp.int32) // k, (g, s * k))
        # token_of_slot[g, e * c + p]: the token in slot p of expert e; s (a zero row): empty.
        token_of_slot = jnp.full((g, e * c + 1), s, jnp.int32)
        # Per group (vmap): a scatter batched over groups stays split like the groups, where
        # indexing groups by an iota made XLA gather every group's slots onto every device.
        token_of_slot = jax.vmap(lambda t, i, v: t.at[i].set(v))(token_of_slot, slot, token)
        padded = jnp.concatenate([x, jnp.zeros((g, 1, d), x.dtype)], axis=1)
        expert_in = jnp.take_along_axis(padded, token_of_slot[:, : e * c, None], axis=1)
        expert_in = constrain(expert_in.reshape(g, e, c, d), _BY_GROUP)
        expert_out = experts(expert_in.transpose(1, 0, 2, 3))  # [e, g, c, d]
        expert_out = constrain(expert_out.transpose(1, 0, 2, 3), _BY_GROUP)
        out = jnp.concatenate(
            [expert_out.reshape(g, e * c, d), jnp.zeros((g, 1, d), x.dtype)], axis=1
        )
        y = jnp.take_along_axis(out, slot[:, :, None], axis=1)  # [g, s * k, d]
        return _combine(y.reshape(g, s, k, d), routing)


class RaggedDispatch(Dispatch):
    """All kept choices sorted by expert and run as one `jax.lax.ragged_dot` per weight.

    Exact (model) FLOPs where XLA has a ragged dot (GPU, TPU); XLA:CPU lowers it to a dense
    dot over every expert. The sort is global, so this dispatch has no expert-parallel
    layout: XLA gathers what it needs.
    """

    def forward(self, x, routing, experts):
        g, s, d = x.shape
        e = experts.num_experts
        k = routing.expert_index.shape[-1]
        # Dropped choices sort last, past every expert's group.
        expert = jnp.where(routing.kept, routing.expert_index, e).reshape(-1)  # [g * s * k]
        order = jnp.argsort(expert, stable=True)
        rows = x.reshape(g * s, d)[order // k]
        group_sizes = jnp.bincount(expert, length=e + 1)[:e].astype(jnp.int32)
        y = experts.ragged(rows, group_sizes)
        y = jnp.where((jnp.arange(y.shape[0]) < jnp.sum(group_sizes))[:, None], y, 0)
        inverse = jnp.zeros_like(order).at[order].set(jnp.arange(order.shape[0], dtype=order.dtype))
        return _combine(y[inverse].reshape(g, s, k, d), routing)


class BalancedDispatch(Dispatch):
    """Drop-free on any backend: choices sorted by expert; each expert's first
    `buffer_factor` x choices / experts (half an even share by default) run as one batched
    matmul over an [expert, slot] buffer; the rest runs in a loop of `tile_size`-row tiles
    that read the weights in place (`overflow_ffn`). Summaries: `moe/overflow_fraction` (of
    the choices) and `moe/overflow_rows` (rows the loop ran, padding included).

    Executes the model's expert FLOPs plus the empty slots of experts with fewer choices
    than slots and the padding of each expert's last tile. Memory: the buffer holds at most
    the choices once; no expert's weights are copied. XLA's cost analysis counts the loop's
    body once, whatever number of tiles ran. A tile's dots run slower per FLOP than the
    buffer's on CPU, and the smaller the tile the slower (against a dense FFN of the same
    FLOPs: the buffer ~1.3x, 128-row tiles ~2.3x, 32-row ~3.7x), which is the trade
    `buffer_factor` and `tile_size` set. The sort is global: no expert-parallel layout
    (`alltoall` adds one).
    """

    @config_class
    class Config(Dispatch.Config):
        # Buffer slots per expert: buffer_factor x choices / experts. Lower wastes fewer
        # empty slots when routing is skewed and sends more rows to the (slower) loop.
        buffer_factor: float = 0.5
        # Rows per overflow tile (at most the choices). Each overflowing expert's last tile
        # pads up to tile_size - 1 rows; smaller tiles run slower per row on CPU. None: 128
        # (what runs saved before the tile was fixed hold).
        tile_size: int | None = _TILE

    def __init__(self, cfg: Config, *, parent=None):
        super().__init__(cfg, parent=parent)
        if cfg.tile_size is not None and cfg.tile_size < 1:
            raise ConfigError(f"{self.path}.tile_size: {cfg.tile_size} must be >= 1")
        if not cfg.buffer_factor > 0:
            raise ConfigError(f"{self.path}.buffer_factor: {cfg.buffer_factor} must be > 0")

    def tile(self, choices: int) -> int:
        """Rows per overflow tile for `choices` rows: `tile_size`, at most the choices."""
        return min(self._config.tile_size or _TILE, choices)

    def forward(self, x, routing, experts):
        g, s, d = x.shape
        k = routing.expert_index.shape[-1]
        m = g * s * k
        expert = jnp.where(routing.kept, routing.expert_index, experts.num_experts).reshape(m)
        token = jnp.arange(m, dtype=jnp.int32) // k
        y = self.rows(x.reshape(g * s, d), expert, token, experts)
        return _combine(y.reshape(g, s, k, d), routing)

    def rows(self, x, expert, token, experts) -> jax.Array:
        """[m, dim]: choice c's expert `expert[c]` (num_experts: none, zeros) run on row
        `token[c]` of x [tokens, dim]; records the overflow summaries."""
        m, e = expert.shape[0], experts.num_experts
        slots = max(1, min(m, math.ceil(self._config.buffer_factor * m / e)))
        y, count, loop_rows = balanced_rows(x, expert, token, experts, slots, self.tile(m))
        spilled = jnp.sum(jnp.maximum(count - slots, 0))
        self.add_summary("moe/overflow_fraction", spilled.astype(jnp.float32) / m)
        self.add_summary("moe/overflow_rows", loop_rows)
        return y


def balanced_rows(x, expert, token, experts: Experts, slots: int, tile: int):
    """(y [m, dim], choices per expert [e], rows the overflow loop ran) of
    `BalancedDispatch.rows`, without summaries (it runs inside shard_maps too)."""
    n, d = x.shape
    m, e = expert.shape[0], experts.num_experts
    # Choices by expert, in choice order within an expert; `none` (e) sorts last.
    sorted_expert, order = jax.lax.sort(
        (expert, jnp.arange(m, dtype=jnp.int32)), num_keys=1, is_stable=True
    )
    bounds = jnp.searchsorted(sorted_expert, jnp.arange(e + 1, dtype=jnp.int32))
    begin, count = bounds[:-1], bounds[1:] - bounds[:-1]
    sorted_token = jnp.concatenate([token[order], jnp.full((tile,), n, jnp.int32)])
    rows = jnp.concatenate([x, jnp.zeros((1, d), x.dtype)])
    # The buffer: slot p of expert e holds its p-th choice (row n: an empty slot).
    rank = jnp.arange(slots, dtype=jnp.int32)
    filled = rank < count[:, None]
    slot_token = jnp.where(filled, sorted_token[jnp.minimum(begin[:, None] + rank, m - 1)], n)
    buffered = experts(rows[slot_token][:, None])[:, 0]  # [e, slots, d]
    # The overflow: each expert's rows past its slots, in tiles.
    weights = (experts.wi_up, experts.wo, experts.wi_gate)
    first, last = jnp.full_like(count, slots), jnp.maximum(count, slots)
    act = experts.activation
    overflow = overflow_ffn(rows, weights, sorted_token, begin, first, last, tile, act)
    loop_rows = overflow_tiles(first, last, tile)[1][-1] * tile
    # Each choice reads its buffer slot, or its overflow row, or (none) the zero row.
    position = jnp.zeros((m,), jnp.int32).at[order].set(jnp.arange(m, dtype=jnp.int32))
    ex = jnp.minimum(expert, e - 1)
    choice_rank = position - begin[ex]
    source = jnp.where(choice_rank < slots, ex * slots + choice_rank, e * slots + position)
    source = jnp.where(expert < e, source, e * slots + m)
    zero = jnp.zeros((1, d), x.dtype)
    table = jnp.concatenate([buffered.reshape(e * slots, d), overflow[:m], zero])
    return table[source], count, loop_rows
