"""`ContextParallelAttention`: the attention kernel slot of a sequence split over the `seq`
mesh axis, by ring, all-to-all or all-gather; and the `context_parallel` modifier."""

from __future__ import annotations

import dataclasses
import logging
import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from axplug.api import AttentionMask
from axplug.api.config import (
    ConfigBase,
    ConfigError,
    ConfigModifier,
    config_class,
    find_configs,
    replace_config,
)
from axplug.api.kernels import select_kernel
from axplug.api.layers import BlockwiseAttention, DotProductKernel, FlashAttention
from axplug.api.sharding import current_scope, sharding_scope
from axplug_context_parallel.heads import all_gather_attention, all_to_all_attention
from axplug_context_parallel.layout import from_zigzag, to_zigzag
from axplug_context_parallel.ring import Skip, ring_attention, ring_work

__all__ = ["STRATEGIES", "ContextParallelAttention", "ContextParallelModifier"]

log = logging.getLogger("axplug.kernels")

STRATEGIES = ("ring", "all_to_all", "usp", "all_gather")


class ContextParallelAttention(FlashAttention):
    """Attention of a sequence split over the `seq` mesh axis, each device keeping its share.

    - `ring`: keys and values pass around the devices (`ppermute`), one block a step, merged
      by log-sum-exp; per-device memory O(seq / n). Under a causal mask with `load_balance`
      the tokens are taken in zigzag order, so every device does the same work.
    - `all_to_all` (Ulysses): heads <-> sequence, the whole sequence of n-th of the heads on
      each device; the heads a device holds must split n ways.
    - `usp` (both): all-to-all within groups of `heads_ways` devices (None: as many as divide
      the heads), a ring across the groups: for more devices than heads.
    - `all_gather`: every device gathers every key and value (memory O(seq)).

    It is a `FlashAttention` slot: per-shard work runs the kernels its dispatch picks
    (`kernels`, `backend`), the ring's those with `forward_lse` (else the blockwise kernel),
    and without a sharded sequence (no mesh, seq=1, decoding) it is that slot alone.
    """

    @config_class
    class Config(FlashAttention.Config):
        strategy: str = "ring"  # one of STRATEGIES
        load_balance: bool = True  # ring, causal: zigzag token order (equal work per device)
        heads_ways: int | None = None  # usp: devices per all-to-all group; None: gcd(n, heads)

    def __init__(self, cfg: Config, *, parent=None):
        super().__init__(cfg, parent=parent)
        if cfg.strategy not in STRATEGIES:
            raise ConfigError(
                f"{self.path}.strategy: {cfg.strategy!r} is not a context-parallel strategy; "
                f"use one of {', '.join(STRATEGIES)}"
            )

    def _scale(self, q) -> float:
        scale = self._config.scale
        return scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])

    def _attend(self, q, k, v, mask):
        return FlashAttention.forward(self, q, k, v, mask)

    def forward(self, q, k, v, mask: AttentionMask) -> jax.Array:
        scope = current_scope()
        ways = 1 if scope is None else scope.axis_size("seq", q.shape[1])
        if scope is None or ways == 1 or q.shape[1] != k.shape[1]:
            return self._attend(q, k, v, mask)  # nothing split, or a decode step's cache
        if mask.q_causal_limits is not None:
            raise ConfigError(
                f"{self.path}: causal limits (bidirectional spans) are not context-parallel; "
                "drop the context_parallel modifier for this model"
            )
        zigzag = self._zigzag(mask, q.shape[1], ways)
        names = scope.mesh_axes("seq", q.shape[1])
        axis = names[0] if len(names) == 1 else names
        q_spec = scope.spec(("batch", "seq", "heads", None), q.shape)
        kv_spec = scope.spec(("batch", "seq", "heads", None), k.shape)
        if q_spec[2] != kv_spec[2]:  # heads split unlike kv heads (GQA): heads stay whole
            q_spec = PartitionSpec(*q_spec[:2], None, None)
            kv_spec = PartitionSpec(*kv_spec[:2], None, None)
        mask_spec = jax.tree.map(lambda _: PartitionSpec(*q_spec[:2]), mask)
        if mask.linear_bias_slopes is not None:
            mask_spec = dataclasses.replace(mask_spec, linear_bias_slopes=PartitionSpec(q_spec[2]))

        def per_shard(q, k, v, mask):
            with sharding_scope(None):
                return self._per_shard(q, k, v, mask, axis, ways, zigzag)

        return jax.shard_map(
            per_shard, mesh=scope.mesh, in_specs=(q_spec, kv_spec, kv_spec, mask_spec),
            out_specs=q_spec, check_vma=False,
        )(q, k, v, mask)  # fmt: skip

    def context_parallel_summary(self, ways: int) -> dict:
        """What `axplug aot` reports for a `ways`-device seq axis: the strategy and, for the
        ring, each device's attention work under a causal mask (max / min over devices)."""
        cfg = self._config
        summary = {"strategy": cfg.strategy, "ways": ways}
        text = f"{cfg.strategy} over {ways} seq devices"
        rings = ways
        if cfg.strategy == "usp":
            if not cfg.heads_ways:  # chosen from the heads at trace time: no ring to report
                return summary | {"description": text + " (all-to-all ways: gcd with the heads)"}
            rings = ways // cfg.heads_ways
            text += f" ({cfg.heads_ways} by all-to-all, {rings} by ring)"
        if cfg.strategy in ("ring", "usp") and rings > 1:
            work = ring_work(rings, Skip.ZIGZAG if cfg.load_balance else Skip.CONTIGUOUS)
            other = ring_work(rings, Skip.CONTIGUOUS if cfg.load_balance else Skip.ZIGZAG)
            summary |= {"work_per_device": work.tolist(), "balance": float(work.max() / work.min())}
            order = "zigzag" if cfg.load_balance else "mesh"
            text += (
                f", {order} order: causal attention work per device max/min "
                f"{summary['balance']:.2f} ({'mesh' if cfg.load_balance else 'zigzag'} order: "
                f"{other.max() / other.min():.2f})"
            )
        return summary | {"description": text}

    def _zigzag(self, mask, seq: int, ways: int) -> bool:
        cfg = self._config
        zigzag = cfg.strategy in ("ring", "usp") and cfg.load_balance and mask.causal
        if zigzag and seq % (2 * ways):
            raise ConfigError(
                f"{self.path}.load_balance: {seq} tokens cannot be cut into the {2 * ways} "
                f"chunks of a balanced ring over {ways} devices; use a sequence length that "
                f"is a multiple of {2 * ways}, or load_balance=false"
            )
        return zigzag

    def _per_shard(self, q, k, v, mask, axis, ways: int, zigzag: bool):
        strategy = self._config.strategy
        if strategy == "all_gather":
            return all_gather_attention(q, k, v, mask, axis=axis, attend=self._attend)
        if strategy == "all_to_all":
            return all_to_all_attention(
                q, k, v, mask, axis=axis, ways=ways, attend=self._attend, path=self.path
            )
        if zigzag:
            q, k, v, mask = jax.tree.map(lambda x: _zigzag_seq(x, axis, ways), (q, k, v, mask))
        heads_ways = self._heads_ways(q.shape[2], ways) if strategy == "usp" else 1
        rings = ways // heads_ways
        skip = Skip.ZIGZAG if zigzag else Skip.CONTIGUOUS if mask.causal else Skip.NONE
        regroup = zigzag and heads_ways > 1

        def ring(q, k, v, mask):
            if regroup:  # the group's chunks come interleaved: early ones, then late ones
                q, k, v, mask = jax.tree.map(lambda x: _regrouped(x, heads_ways), (q, k, v, mask))
            cfg = self._config
            name, kernel = select_kernel(
                q, k, v, mask, backend=cfg.backend, names=cfg.kernels, lse=True
            )
            log.debug("%s: ring block kernel %s", self.path, name)
            out = ring_attention(
                q, k, v, mask, scale=self._scale(q), axis=axis, ways=rings, kernel=kernel,
                skip=skip, stride=heads_ways,
            )  # fmt: skip
            return _regrouped(out, heads_ways, inverse=True) if regroup else out

        if heads_ways == 1:
            out = ring(q, k, v, mask)
        else:
            groups = [list(range(g * heads_ways, (g + 1) * heads_ways)) for g in range(rings)]
            out = all_to_all_attention(
                q, k, v, mask, axis=axis, ways=heads_ways, attend=ring, path=self.path,
                groups=groups,
            )  # fmt: skip
        return from_zigzag(out, axis, ways) if zigzag else out

    def _heads_ways(self, heads: int, ways: int) -> int:
        chosen = self._config.heads_ways or math.gcd(heads, ways)
        if ways % chosen:
            raise ConfigError(
                f"{self.path}.heads_ways: {chosen} does not divide the {ways} devices of the "
                "seq mesh axis; use a divisor of it"
            )
        return chosen


def _zigzag_seq(x, axis, ways):
    """`to_zigzag` of a [b, s, ...] array; the mask's bias slopes ([heads]) stay."""
    return to_zigzag(x, axis, ways) if x.ndim >= 2 else x


def _regrouped(x, group: int, *, inverse: bool = False):
    """A `group`-device all-to-all's sequence of zigzag shards [e0, l0, e1, l1, ...] (each
    an early and a late chunk) as its early chunks, then its late ones, each run in sequence
    order: [e0, e1, ..., l1, l0]; `inverse`: back."""
    if x.ndim < 2:
        return x
    order = list(range(0, 2 * group, 2)) + list(range(2 * group - 1, 0, -2))
    if inverse:
        order = sorted(range(2 * group), key=order.__getitem__)
    b, s = x.shape[:2]
    pieces = x.reshape(b, 2 * group, s // (2 * group), *x.shape[2:])
    return pieces[:, jnp.asarray(order)].reshape(x.shape)


_SLOTS = (DotProductKernel, FlashAttention, BlockwiseAttention)


class ContextParallelModifier(ConfigModifier):
    """`--modifier context_parallel:strategy=ring`: every attention kernel slot splits the
    sequence over the `seq` mesh axis by `strategy` (give the mesh a seq axis:
    `--modifier mesh:seq=8`)."""

    @config_class
    class Config(ConfigModifier.Config):
        strategy: str = "ring"
        load_balance: bool = True
        heads_ways: int | None = None  # usp: devices per all-to-all group

    def __call__(self, cfg: ConfigBase) -> ConfigBase:
        own = self._config
        new = ContextParallelAttention.default_config().set(
            strategy=own.strategy, load_balance=own.load_balance, heads_ways=own.heads_ways
        )
        found = sum(len(find_configs(cfg, slot)) for slot in (*_SLOTS, ContextParallelAttention))
        if not found:
            raise ConfigError(
                "modifier 'context_parallel': the config has no attention kernel slot "
                "(DotProductKernel, FlashAttention, BlockwiseAttention) to replace"
            )
        for slot in (*_SLOTS, ContextParallelAttention):
            cfg = replace_config(
                cfg, target=slot, new_cfg=new, owned=("strategy", "load_balance", "heads_ways"),
                missing_ok=True,
            )  # fmt: skip
        # Built once here, so a bad strategy is one error before anything is traced.
        if own.strategy not in STRATEGIES:
            raise ConfigError(
                f"modifier 'context_parallel': strategy {own.strategy!r} is not one of "
                f"{', '.join(STRATEGIES)}"
            )
        return cfg
