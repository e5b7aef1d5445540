"""The attention kernel interface and the two kernels this package ships (reference, XLA).

A kernel is registered under the `axplug.kernels` entry-point group; the entry loads a class
(instantiated with no arguments) or an instance with:

- `priority: int` - higher is tried first (reference 0, xla 10; hardware kernels use 100+);
- `is_supported(query, key, value, mask, backend) -> True | Unsupported(reason)` - decides from
  shapes, dtypes, the mask's static fields and the backend name only (arguments may be
  `jax.ShapeDtypeStruct`s), so the choice is made once at trace time;
- `__call__(query, key, value, mask, *, scale) -> out` - query [b, sq, h, d],
  key/value [b, skv, kvh, d] with h % kvh == 0, mask an `axplug.layers.AttentionMask`;
  returns [b, sq, h, d] in value's dtype, differentiable.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from axplug.layers import AttentionMask

__all__ = ["AttentionKernel", "Unsupported", "ReferenceKernel", "XlaKernel", "check_shapes"]


class Unsupported:
    """A false `is_supported` answer that says why."""

    __slots__ = ("reason",)

    def __init__(self, reason: str):
        self.reason = reason

    def __bool__(self) -> bool:
        return False

    def __repr__(self) -> str:
        return f"Unsupported({self.reason!r})"


class AttentionKernel:
    """Base of attention kernels (subclassing is optional: the protocol is what counts)."""

    priority: int = 0

    def is_supported(self, query, key, value, mask: AttentionMask, backend: str):
        problem = check_shapes(query, key, value)
        return True if problem is None else problem

    def __call__(self, query, key, value, mask: AttentionMask, *, scale: float) -> jax.Array:
        raise NotImplementedError(type(self).__qualname__)

    @classmethod
    def info_lines(cls) -> list[str]:
        """Extra lines for `axplug info`: every kernel's answer here and the one chosen."""
        from axplug_attention.dispatch import describe_kernels

        return describe_kernels()


def check_shapes(query, key, value) -> Unsupported | None:
    """None when q/k/v have the shapes every kernel expects, else why not."""
    if query.ndim != 4 or key.ndim != 4 or value.ndim != 4:
        return Unsupported("q, k, v must be [batch, seq, heads, head_dim]")
    if key.shape != value.shape:
        return Unsupported(f"key {key.shape} and value {value.shape} shapes differ")
    h, kvh = query.shape[2], key.shape[2]
    if h % kvh:
        return Unsupported(f"{h} query heads not divisible by {kvh} kv heads")
    if query.shape[-1] != key.shape[-1]:
        return Unsupported(f"query head_dim {query.shape[-1]} != key head_dim {key.shape[-1]}")
    return None


class ReferenceKernel(AttentionKernel):
    """Plain jnp softmax attention in float32: runs everywhere, the fallback and the yardstick."""

    priority = 0

    def __call__(self, query, key, value, mask, *, scale):
        b, sq, h, d = query.shape
        kvh = key.shape[2]
        qg = query.reshape(b, sq, kvh, h // kvh, d)  # [b, sq, kvh, group, d]
        logits = jnp.einsum("bqngd,bknd->bngqk", qg, key, preferred_element_type=jnp.float32)
        allowed = mask.dense()[:, :, None]  # [b, 1, 1, sq, skv]
        logits = jnp.where(allowed, logits * scale, -1e30)
        probs = jax.nn.softmax(logits, axis=-1).astype(value.dtype)
        out = jnp.einsum("bngqk,bknd->bqngd", probs, value)
        return out.reshape(b, sq, h, d)


class XlaKernel(AttentionKernel):
    """`jax.nn.dot_product_attention(implementation="xla")` with the mask made from positions."""

    priority = 10

    def is_supported(self, query, key, value, mask, backend):
        if (problem := check_shapes(query, key, value)) is not None:  # Unsupported is falsy
            return problem
        if not jnp.issubdtype(query.dtype, jnp.floating):
            return Unsupported(f"dtype {query.dtype} is not floating point")
        if not query.dtype == key.dtype == value.dtype:
            return Unsupported("q, k, v dtypes differ")
        return True

    def __call__(self, query, key, value, mask, *, scale):
        # The mask comes from positions, not indices: packed sequences and decode offsets work.
        return jax.nn.dot_product_attention(
            query, key, value, mask=mask.dense(), scale=scale, implementation="xla"
        )
