"""Dispatch: send routed tokens to their experts and combine the results.

Every dispatch computes, for each token, sum_k combine_weight[k] * expert_{index[k]}(x)
over the choices the router kept; they differ only in how the work is laid out:

- `einsum` (GShard): one-hot [token, expert, slot] dispatch and combine einsums. Executes
  capacity x the model's expert FLOPs plus two one-hot einsums quadratic in the group size.
  Expert parallel (all-to-all).
- `gather`: tokens gathered into [expert, group, slot] buffers by slot index, outputs
  gathered back per choice. Executes capacity x the model's expert FLOPs. Expert parallel.
- `sorted`: choices sorted by expert into fixed-size tiles, one batched matmul against
  per-tile weight copies. Executes about the model's expert FLOPs, drop-free or not; small
  models only (weight copies); no expert-parallel layout.
- `ragged`: choices sorted by expert, `jax.lax.ragged_dot`. The model's FLOPs on GPU/TPU;
  XLA:CPU lowers it to a dense dot over every expert. No expert-parallel layout.
- `auto`: drop-free: `ragged` on GPU/TPU, `sorted` elsewhere; with a capacity: `gather`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp

from axplug.config import ConfigError, config_class
from axplug.layers import BaseLayer
from axplug.sharding import constrain
from axplug_moe.router import Routing

__all__ = [
    "Experts",
    "Dispatch",
    "EinsumDispatch",
    "GatherDispatch",
    "RaggedDispatch",
    "SortedDispatch",
    "AutoDispatch",
    "DISPATCHERS",
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

    def tiles(self, x: jax.Array, tile_expert: jax.Array) -> jax.Array:
        """[tiles, rows, dim], tile t run by expert tile_expert[t] -> same shape."""
        up = jnp.einsum("tbd,tdh->tbh", x, self.wi_up[tile_expert])
        if self.wi_gate is not None:
            gate = jnp.einsum("tbd,tdh->tbh", x, self.wi_gate[tile_expert])
            h = self.activation(gate) * up
        else:
            h = self.activation(up)
        return jnp.einsum("tbh,thd->tbd", h, self.wo[tile_expert])

    def ragged(self, x: jax.Array, group_sizes: jax.Array) -> jax.Array:
        """[rows, dim] sorted by expert, group_sizes[e] rows each -> [rows, dim]."""
        h = jax.lax.ragged_dot(x, self.wi_up, group_sizes)
        if self.wi_gate is not None:
            h = self.activation(jax.lax.ragged_dot(x, self.wi_gate, group_sizes)) * h
        else:
            h = self.activation(h)
        return jax.lax.ragged_dot(h, self.wo, group_sizes)


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


class SortedDispatch(Dispatch):
    """Choices sorted by expert into tiles of `tile_size` rows, each tile one expert's, run as
    one batched matmul against per-tile copies of the expert weights (a grouped GEMM that
    every backend runs). Executes (choices + experts x tile) / choices x the model's expert
    FLOPs with or without drops: the drop-free dispatch for CPU. The per-tile weight copies
    make it a small-model dispatch, and its sort is global (no expert-parallel layout)."""

    @config_class
    class Config(Dispatch.Config):
        tile_size: int = 128

    def __init__(self, cfg: Config, *, parent=None):
        super().__init__(cfg, parent=parent)
        if cfg.tile_size < 1:
            raise ConfigError(f"{self.path}.tile_size: {cfg.tile_size} must be >= 1")

    def forward(self, x, routing, experts):
        g, s, d = x.shape
        e = experts.num_experts
        k = routing.expert_index.shape[-1]
        m = g * s * k
        # Tiles no taller than an even share of the choices, so few choices (decoding) do
        # not pad every expert to a full tile.
        b = max(1, min(self._config.tile_size, -(-m // e)))
        num_tiles = -(-m // b) + e  # sum_e ceil(n_e / b) <= m / b + e
        expert = jnp.where(routing.kept, routing.expert_index, e).reshape(m)
        order = jnp.argsort(expert, stable=True)
        sorted_expert = expert[order]
        counts = jnp.bincount(expert, length=e + 1)[:e]
        tile_end = jnp.cumsum((counts + b - 1) // b)
        tile_begin = tile_end - (counts + b - 1) // b
        row_begin = jnp.cumsum(counts) - counts
        # Padded row of each sorted choice; dropped ones (expert e) go to a spare row.
        ex = jnp.minimum(sorted_expert, e - 1)
        rank = jnp.arange(m) - row_begin[ex]
        padded = jnp.where(sorted_expert < e, tile_begin[ex] * b + rank, num_tiles * b)
        # Which token fills each padded row (g * s: the zero row).
        token = jnp.full((num_tiles * b + 1,), g * s, jnp.int32)
        token = token.at[padded].set((order // k).astype(jnp.int32))[: num_tiles * b]
        rows = jnp.concatenate([x.reshape(g * s, d), jnp.zeros((1, d), x.dtype)])[token]
        tile_expert = jnp.searchsorted(tile_end, jnp.arange(num_tiles), side="right")
        out = experts.tiles(rows.reshape(num_tiles, b, d), jnp.minimum(tile_expert, e - 1))
        out = jnp.concatenate([out.reshape(num_tiles * b, d), jnp.zeros((1, d), x.dtype)])
        y = out[padded]  # sorted order
        inverse = jnp.zeros_like(order).at[order].set(jnp.arange(m, dtype=order.dtype))
        return _combine(y[inverse].reshape(g, s, k, d), routing)


class AutoDispatch(Dispatch):
    """When no choice can be dropped (capacity >= group size): `ragged` on GPU/TPU, `sorted`
    elsewhere; with a capacity: `gather`. Chosen at trace time (measured on CPU only)."""

    def __init__(self, cfg: Dispatch.Config, *, parent=None):
        super().__init__(cfg, parent=parent)
        self._add_child("gather", GatherDispatch.default_config())
        self._add_child("ragged", RaggedDispatch.default_config())
        self._add_child("sorted", SortedDispatch.default_config())

    @staticmethod
    def choose(backend: str, capacity: int, group_size: int) -> str:
        """The dispatch `auto` runs for this backend and (static) capacity."""
        if capacity < group_size:
            return "gather"
        return "ragged" if backend in ("gpu", "tpu") else "sorted"

    def forward(self, x, routing, experts):
        name = self.choose(jax.default_backend(), routing.capacity, x.shape[1])
        return getattr(self, name)(x, routing, experts)


# The `dispatch` option of the `moe` modifier.
DISPATCHERS: dict[str, type[Dispatch]] = {
    "auto": AutoDispatch,
    "einsum": EinsumDispatch,
    "gather": GatherDispatch,
    "ragged": RaggedDispatch,
    "sorted": SortedDispatch,
}
