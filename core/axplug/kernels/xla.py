"""`jax.nn.dot_product_attention(implementation="xla")` as a kernel: exact under any sharding."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from axplug.api import AttentionKernel, Unsupported, check_shapes
from axplug.kernels.reference import reference_attention

__all__ = ["XlaKernel"]


class XlaKernel(AttentionKernel):
    """`jax.nn.dot_product_attention(implementation="xla")` with the mask made from positions.

    XLA partitions it like any jnp code, so it stays exact when the sequence is sharded (the
    keys and values arrive gathered): dispatch falls back to it where flash kernels decline.
    """

    priority = 10
    supports_linear_bias = True  # AttentionMask.linear_bias_slopes (plugin API 1.1)
    # AttentionMask.logit_softcap: jax.nn.dot_product_attention takes no cap, so a capped
    # call runs the reference math, which XLA partitions alike.
    supports_logit_softcap = True
    supports_causal_limits = True  # through dense()

    def is_supported(self, query, key, value, mask, backend):
        if (problem := check_shapes(query, key, value)) is not None:  # Unsupported is falsy
            return problem
        if not jnp.issubdtype(query.dtype, jnp.floating):
            return Unsupported(f"dtype {query.dtype} is not floating point")
        if not query.dtype == key.dtype == value.dtype:
            return Unsupported("q, k, v dtypes differ")
        return True

    def __call__(self, query, key, value, mask, *, scale):
        if mask.logit_softcap is not None:
            return reference_attention(
                query, key, value, mask.dense(), scale=scale, bias=mask.bias(),
                logit_softcap=mask.logit_softcap,
            )  # fmt: skip
        # The mask comes from positions, not indices: packed sequences and decode offsets work.
        return jax.nn.dot_product_attention(
            query, key, value, bias=mask.bias(), mask=mask.dense(), scale=scale,
            implementation="xla",
        )  # fmt: skip
