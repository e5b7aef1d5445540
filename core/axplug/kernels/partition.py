"""Hardware kernels run per device shard: `shard_over_batch` wraps their calls in shard_map.

Mosaic (Pallas TPU), Triton and NKI calls are opaque to XLA's partitioner: Mosaic refuses to
lower on a sharded operand, and the others would be replicated (every device gathering the
whole batch). Attention is independent across batch rows and heads, so the call runs as is
on each device's rows and heads. The layout comes from the sharding scope the Trainer, `aot`
and the Engine trace in (`axplug.sharding.current_scope()`): the batch dim over the mesh axes
of logical `batch`, heads over those of `heads` where they divide both query and kv heads,
everything else replicated. A sequence sharded over the `seq` mesh axis is not per-shard work
(each query shard needs every key): such calls are for the XLA kernel, and hardware kernels'
`is_supported` answers `check_sequence_sharding(query)`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
from jax.sharding import PartitionSpec

from axplug.api import Unsupported
from axplug.sharding import current_scope, sharding_scope

__all__ = ["attention_specs", "check_sequence_sharding", "shard_over_batch"]

_LAYOUT = ("batch", None, "heads", None)  # [batch, seq, heads, head_dim]


def attention_specs(scope, query, key) -> tuple[PartitionSpec, PartitionSpec]:
    """(query/output spec, key/value spec) of a per-shard attention call in `scope`."""
    q_spec = scope.spec(_LAYOUT, query.shape)
    kv_spec = scope.spec(_LAYOUT, key.shape)
    if q_spec[2] != kv_spec[2]:
        # The heads mesh axes must split query and kv heads alike to keep each query head's
        # kv head on its device (GQA); otherwise heads stay whole on every device.
        q_spec = PartitionSpec(q_spec[0], None, None, None)
        kv_spec = PartitionSpec(kv_spec[0], None, None, None)
    return q_spec, kv_spec


def shard_over_batch(fn: Callable, query, key, value, mask, **kwargs: Any) -> jax.Array:
    """`fn(query, key, value, mask, **kwargs)` run on each device's batch rows (and heads).

    Where `current_scope()` is None (no mesh, `sharding_scope(None)`, inside a shard_map) or
    has one device it is a plain call.
    `mask` is an `AttentionMask`: its positions and segment ids are split like the batch, its
    bias slopes like the heads.
    """
    scope = current_scope()
    # current_scope() is None inside a shard_map (ours or a caller's): operands are shards.
    if scope is None or scope.mesh.size == 1:
        return fn(query, key, value, mask, **kwargs)
    q_spec, kv_spec = attention_specs(scope, query, key)
    rows = PartitionSpec(q_spec[0])
    mask_spec = jax.tree.map(lambda _: rows, mask)
    if mask.linear_bias_slopes is not None:  # [heads]: split like the query heads
        mask_spec = dataclasses.replace(mask_spec, linear_bias_slopes=PartitionSpec(q_spec[2]))

    def per_shard(q, k, v, m):
        with sharding_scope(None):  # nothing inside may lay out for the global mesh
            return fn(q, k, v, m, **kwargs)

    # check_vma=False: Pallas and NKI calls carry no varying-across-mesh annotations.
    return jax.shard_map(
        per_shard,
        mesh=scope.mesh,
        in_specs=(q_spec, kv_spec, kv_spec, mask_spec),
        out_specs=q_spec,
        check_vma=False,
    )(query, key, value, mask)


def check_sequence_sharding(query) -> Unsupported | None:
    """Unsupported when the current scope shards the query's sequence, else None."""
    scope = current_scope()
    if scope is None:
        return None
    axes = scope.spec(("batch", "seq", "heads", None), query.shape)[1]
    if axes is None:
        return None
    names = (axes,) if isinstance(axes, str) else tuple(axes)
    ways = 1
    for name in names:
        ways *= scope.mesh.shape[name]
    return Unsupported(
        f"sequence sharded over the {'/'.join(names)} mesh axis ({ways} ways): a per-shard "
        "flash kernel would see only its shard's keys; the XLA kernel attends to the "
        "gathered keys exactly"
    )
