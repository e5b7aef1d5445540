"""Pytree checks around saving and restoring: the non-finite guard and abstract targets."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from axplug.checkpoint.checksum import host_blocks, in_host_memory

__all__ = ["first_non_finite", "abstract_target"]


def _is_float(dtype: Any) -> bool:
    return jnp.issubdtype(dtype, jnp.inexact)


@jax.jit
def _finite_flags(leaves: list[jax.Array]) -> jax.Array:
    # One program for the whole state: on a multi-device mesh every eager op would be its own
    # SPMD launch, and dozens of them race the training step for the same devices.
    return jnp.stack([jnp.all(jnp.isfinite(leaf)) for leaf in leaves])


def _host_finite(value: Any) -> bool:
    # Block by block: XLA's CPU compiler would materialize `isfinite` of the whole leaf.
    return all(bool(np.all(np.isfinite(block))) for _, block in host_blocks(value))


def first_non_finite(state: Any) -> str | None:
    """The key path (`['params']['w']`) of the first leaf with a NaN or inf, or None."""
    leaves, _ = jax.tree_util.tree_flatten_with_path(state)
    paths, arrays = [], []
    for path, leaf in leaves:
        if isinstance(leaf, jax.Array) and not in_host_memory(leaf):
            if _is_float(leaf.dtype):
                paths.append(path)
                arrays.append(leaf)
        elif isinstance(leaf, (jax.Array, np.ndarray, np.generic, float, complex)):
            dtype = leaf.dtype if isinstance(leaf, jax.Array) else np.asarray(leaf).dtype
            if _is_float(dtype) and not _host_finite(leaf):
                return jax.tree_util.keystr(path)
    if not arrays:
        return None
    for path, ok in zip(paths, jax.device_get(_finite_flags(arrays)), strict=True):
        if not ok:
            return jax.tree_util.keystr(path)
    return None


def abstract_target(target: Any) -> Any:
    """`target` with every leaf a `jax.ShapeDtypeStruct` that has a sharding.

    Arrays give their own shape, dtype and sharding; leaves without a sharding land on the
    first device.
    """

    def convert(leaf: Any) -> jax.ShapeDtypeStruct:
        if isinstance(leaf, (jax.ShapeDtypeStruct, jax.Array)):
            sharding = leaf.sharding
        else:
            leaf, sharding = np.asarray(leaf), None
        if sharding is None:
            sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding)

    return jax.tree.map(convert, target)
