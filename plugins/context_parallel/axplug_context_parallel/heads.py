"""All-to-all (Ulysses) and all-gather context parallelism, inside a shard_map over `seq`.

All-to-all trades the sequence split for a heads split: each device gets the whole sequence
of n-th of the heads, runs the per-shard kernel dispatch picks (a flash kernel where one
exists) and trades back; four all-to-alls a layer, each of one shard's q, k, v or output.
All-gather gives every device every key and value, and its own queries.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from axplug.api import AttentionMask
from axplug.api.config import ConfigError

__all__ = ["all_gather_attention", "all_to_all_attention"]


def _gathered(x, axis, groups=None):
    if x is None:
        return None
    return jax.lax.all_gather(x, axis, axis=1, tiled=True, axis_index_groups=groups)


def all_gather_attention(query, key, value, mask: AttentionMask, *, axis, attend):
    """This device's queries over every device's keys: `attend(q, k, v, mask)`."""
    mask = dataclasses.replace(
        mask,
        kv_positions=_gathered(mask.kv_positions, axis),
        kv_segment_ids=_gathered(mask.kv_segment_ids, axis),
    )
    return attend(query, _gathered(key, axis), _gathered(value, axis), mask)


def all_to_all_attention(
    query, key, value, mask: AttentionMask, *, axis, ways, attend, path, groups=None
):
    """Heads <-> sequence: `attend` on the whole sequence of this device's heads; with
    `groups` (lists of `ways` devices), within each group: the group's part of it."""
    heads, kv_heads = query.shape[2], key.shape[2]
    if heads % ways:
        raise ConfigError(
            f"{path}: all-to-all splits the {heads} query heads a device holds over {ways} "
            "devices of the seq mesh axis, which do not divide them; use strategy='ring', "
            "or fewer all-to-all devices (strategy='usp' with heads_ways dividing them)"
        )
    if kv_heads % ways:  # too few kv heads to split: each device takes its query heads' own
        key = jnp.repeat(key, heads // kv_heads, axis=2)
        value = jnp.repeat(value, heads // kv_heads, axis=2)

    def to_heads(x):  # [b, s / n, h, d] -> [b, s, h / n, d]
        return jax.lax.all_to_all(
            x, axis, split_axis=2, concat_axis=1, tiled=True, axis_index_groups=groups
        )

    slopes = mask.linear_bias_slopes
    if slopes is not None:
        share = heads // ways
        start = jax.lax.axis_index(axis) % ways * share
        slopes = jax.lax.dynamic_slice_in_dim(slopes, start, share)
    mask = dataclasses.replace(
        mask,
        q_positions=_gathered(mask.q_positions, axis, groups),
        kv_positions=_gathered(mask.kv_positions, axis, groups),
        q_segment_ids=_gathered(mask.q_segment_ids, axis, groups),
        kv_segment_ids=_gathered(mask.kv_segment_ids, axis, groups),
        linear_bias_slopes=slopes,
    )
    out = attend(to_heads(query), to_heads(key), to_heads(value), mask)
    return jax.lax.all_to_all(
        out, axis, split_axis=1, concat_axis=2, tiled=True, axis_index_groups=groups
    )
