"""The zigzag token order of a load-balanced causal ring, and back.

The sequence is cut into 2n chunks; in the mesh's order device d holds chunks 2d and 2d + 1,
in zigzag order chunks d and 2n - 1 - d (an early and a late one), so that under a causal
mask every device attends to as many keys as every other. The exchange is two `ppermute`s
inside the shard_map: one of the even-numbered chunks and one of the odd-numbered ones (each
device sends and receives one of each).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

__all__ = ["from_zigzag", "to_zigzag"]


def _zigzag_device(chunk: int, ways: int) -> int:
    return chunk if chunk < ways else 2 * ways - 1 - chunk


def _perms(ways: int, parity: int, *, inverse: bool) -> list[tuple[int, int]]:
    pairs = [(c // 2, _zigzag_device(c, ways)) for c in range(parity, 2 * ways, 2)]
    return [(b, a) for a, b in pairs] if inverse else pairs


def _halves(x):
    half = x.shape[1] // 2
    return x[:, :half], x[:, half:]


def to_zigzag(x: jax.Array, axis, ways: int) -> jax.Array:
    """One device's [b, s, ...] shard in the mesh's order -> its shard in zigzag order."""
    first, second = _halves(x)  # chunks 2d (even) and 2d + 1 (odd)
    even = jax.lax.ppermute(first, axis, _perms(ways, 0, inverse=False))
    odd = jax.lax.ppermute(second, axis, _perms(ways, 1, inverse=False))
    # Device t now holds chunks t and 2n - 1 - t, one even and one odd: t's parity says which.
    t_even = jax.lax.axis_index(axis) % 2 == 0
    return jnp.concatenate([jnp.where(t_even, even, odd), jnp.where(t_even, odd, even)], axis=1)


def from_zigzag(x: jax.Array, axis, ways: int) -> jax.Array:
    """`to_zigzag`'s inverse."""
    early, late = _halves(x)  # chunks t and 2n - 1 - t
    t_even = jax.lax.axis_index(axis) % 2 == 0
    even = jax.lax.ppermute(jnp.where(t_even, early, late), axis, _perms(ways, 0, inverse=True))
    odd = jax.lax.ppermute(jnp.where(t_even, late, early), axis, _perms(ways, 1, inverse=True))
    return jnp.concatenate([even, odd], axis=1)
