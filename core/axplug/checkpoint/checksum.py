"""Per-leaf checksums of a state, the same however the arrays are sharded.

A leaf's checksum is sum_i bits_i * (2i + 1) mod 2**32 over its elements in row-major order,
where bits_i is the element's bit pattern as an unsigned integer (64-bit values as two 32-bit
halves). Integer sums mod 2**32 do not depend on the order of addition, so XLA computes it
shard by shard on the devices (one pass, like a norm) and numpy computes the same number on
the host; changing one element by any nonzero amount d changes the sum by d * (2i + 1), never
0 mod 2**32, so every single flipped bit or byte is caught.

On the host (numpy arrays, and jax arrays held whole by one CPU device, read in place) the sum
runs block by block, with temporaries of one block: XLA's CPU compiler does not fuse the
product into the sum and would materialize a leaf-sized temporary per leaf.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["tree_checksums", "host_checksums", "leaf_names", "in_host_memory", "host_blocks"]

_UNSIGNED = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint32}
# Elements per block of a host pass: 4 Mi (16 MiB of float32).
HOST_BLOCK = 1 << 22


def in_host_memory(x: Any) -> bool:
    """Whether `x` is a jax array held whole by one CPU device: numpy reads it in place."""
    if not isinstance(x, jax.Array):
        return False
    devices = x.sharding.device_set
    return len(devices) == 1 and next(iter(devices)).platform == "cpu"


def host_blocks(x: Any) -> Any:
    """(offset, block) of the flattened `x` (numpy, or `in_host_memory`), `HOST_BLOCK`
    elements at a time, without copying it."""
    flat = np.asarray(x).reshape(-1)
    for start in range(0, flat.shape[0], HOST_BLOCK):
        yield start, flat[start : start + HOST_BLOCK]


def leaf_names(tree: Any) -> list[str]:
    """`a/b/0/c` names of the leaves of `tree`, in flatten order."""
    paths, _ = jax.tree_util.tree_flatten_with_path(tree)
    return ["/".join(_key(k) for k in path) for path, _ in paths]


def _key(entry: Any) -> str:
    for attr in ("key", "idx", "name"):
        if hasattr(entry, attr):
            return str(getattr(entry, attr))
    return str(entry)


def _words(x, xp):
    """The element bit patterns of `x` as a flat uint32 vector (64-bit: two words each)."""
    dtype = np.dtype(x.dtype)
    if dtype == np.bool_:
        x = x.astype(xp.uint8)
        dtype = np.dtype(np.uint8)
    unsigned = _UNSIGNED[dtype.itemsize]
    if dtype.itemsize == 8:
        bits = (
            x.reshape(-1).view(np.uint32)
            if xp is np
            else jax.lax.bitcast_convert_type(x.reshape(-1), jnp.uint32).reshape(-1)
        )
        return bits
    if xp is np:
        return x.reshape(-1).view(unsigned).astype(np.uint32)
    return jax.lax.bitcast_convert_type(x.reshape(-1), unsigned).astype(jnp.uint32)


def _checksum(x, xp, first_word: int = 0) -> Any:
    """The sum over `x`'s words, the first being word `first_word` of its leaf."""
    words = _words(x, xp)
    index = xp.arange(words.shape[0], dtype=xp.uint32) + xp.uint32(first_word % 2**32)
    return xp.sum(words * (index * xp.uint32(2) + xp.uint32(1)), dtype=xp.uint32)


def _host_checksum(x: Any) -> np.uint32:
    words_per_element = 2 if np.dtype(x.dtype).itemsize == 8 else 1
    total = np.uint32(0)
    with np.errstate(over="ignore"):
        for start, block in host_blocks(x):
            total += _checksum(np.ascontiguousarray(block), np, start * words_per_element)
    return total


@jax.jit
def _device_checksums(leaves: list) -> list:
    return [_checksum(x, jnp) for x in leaves]


def tree_checksums(tree: Any) -> dict[str, str]:
    """{leaf name: 8 hex digits} of a tree of (sharded) jax arrays, computed on the devices
    (one program per set of devices the leaves live on; host values on the host)."""
    leaves = jax.tree.leaves(tree)
    groups: dict[Any, list[int]] = {}
    for i, x in enumerate(leaves):
        on_devices = isinstance(x, jax.Array) and not in_host_memory(x)
        devices = frozenset(x.sharding.device_set) if on_devices else None
        groups.setdefault(devices, []).append(i)
    sums: list[Any] = [None] * len(leaves)
    for devices, members in groups.items():
        if devices is None:
            values = [_host_checksum(leaves[i]) for i in members]
        else:
            values = _device_checksums([leaves[i] for i in members])
        for i, value in zip(members, values, strict=True):
            sums[i] = value
    sums = jax.device_get(sums)
    return {name: f"{int(s):08x}" for name, s in zip(leaf_names(tree), sums, strict=True)}


def host_checksums(tree: Any) -> dict[str, str]:
    """`tree_checksums` of a tree of numpy arrays, on the host."""
    sums = [_host_checksum(x) for x in jax.tree.leaves(tree)]
    return {name: f"{int(s):08x}" for name, s in zip(leaf_names(tree), sums, strict=True)}
