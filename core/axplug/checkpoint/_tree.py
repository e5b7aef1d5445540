"""Pytree checks around saving and restoring: the non-finite guard and abstract targets."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["first_non_finite", "abstract_target"]


def _is_float(dtype: Any) -> bool:
    return jnp.issubdtype(dtype, jnp.inexact)


def first_non_finite(state: Any) -> str | None:
    """The key path (`['params']['w']`) of the first leaf with a NaN or inf, or None."""
    leaves, _ = jax.tree_util.tree_flatten_with_path(state)
    paths, flags = [], []
    for path, leaf in leaves:
        if isinstance(leaf, jax.Array):
            if _is_float(leaf.dtype):
                # Reduced on device; all flags come back in one transfer below.
                paths.append(path)
                flags.append(jnp.all(jnp.isfinite(leaf)))
        elif isinstance(leaf, (np.ndarray, np.generic, float, complex)):
            value = np.asarray(leaf)
            if _is_float(value.dtype) and not np.all(np.isfinite(value)):
                return jax.tree_util.keystr(path)
    for path, ok in zip(paths, jax.device_get(flags), strict=True):
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
