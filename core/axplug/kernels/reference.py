"""The reference softmax attention: the one copy of the math, and the kernel that runs it."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from axplug.api import AttentionKernel

__all__ = ["NEG_INF", "ReferenceKernel", "reference_attention", "soft_cap"]

NEG_INF = -1e30


def soft_cap(scores: jax.Array, cap: float | None) -> jax.Array:
    """`cap * tanh(scores / cap)` (attention-logit soft-capping, Gemma 2); None: `scores`."""
    return scores if cap is None else cap * jnp.tanh(scores / cap)


def reference_attention(
    query, key, value, allowed, *, scale: float, bias=None, logit_softcap: float | None = None
) -> jax.Array:
    """softmax(softcap(q k^T * scale) + bias, masked by `allowed`) v, logits in float32.

    query [b, sq, h, d]; key [b, skv, kvh, d], value [b, skv, kvh, dv] with h % kvh == 0;
    allowed boolean [b, 1, sq, skv] (`AttentionMask.dense()`); bias None or float32
    [b, h, sq, skv] (`AttentionMask.bias()`); logit_softcap None or the cap of `soft_cap`
    (`AttentionMask.logit_softcap`). Returns [b, sq, h, dv] in value's dtype.
    """
    b, sq, h, d = query.shape
    kvh = key.shape[2]
    if kvh == h:
        # The plain 4-D layout: the grouped one below makes XLA:CPU copy the probabilities.
        logits = jnp.einsum("bqhd,bkhd->bhqk", query, key, preferred_element_type=jnp.float32)
        if logit_softcap is None:
            logits = logits * scale if bias is None else logits * scale + bias
        else:
            logits = soft_cap(logits * scale, logit_softcap)
            logits = logits if bias is None else logits + bias
        logits = jnp.where(allowed, logits, NEG_INF)
        probs = jax.nn.softmax(logits, axis=-1).astype(value.dtype)
        return jnp.einsum("bhqk,bkhd->bqhd", probs, value)
    qg = query.reshape(b, sq, kvh, h // kvh, d)  # [b, sq, kvh, group, d]
    logits = jnp.einsum("bqngd,bknd->bngqk", qg, key, preferred_element_type=jnp.float32)
    logits = soft_cap(logits * scale, logit_softcap)  # [b, n, g, sq, skv]; head = n * g + g
    if bias is not None:
        logits = logits + bias.reshape(b, kvh, h // kvh, *bias.shape[2:])
    logits = jnp.where(allowed[:, :, None], logits, NEG_INF)
    probs = jax.nn.softmax(logits, axis=-1).astype(value.dtype)
    out = jnp.einsum("bngqk,bknd->bqngd", probs, value)
    return out.reshape(b, sq, h, value.shape[-1])  # v may be narrower or wider than q, k


class ReferenceKernel(AttentionKernel):
    """Plain jnp softmax attention in float32: runs everywhere, the fallback and the yardstick."""

    priority = 0
    supports_linear_bias = True  # AttentionMask.linear_bias_slopes (plugin API 1.1)
    supports_logit_softcap = True  # AttentionMask.logit_softcap
    supports_causal_limits = True  # AttentionMask.q_causal_limits, through dense()

    def __call__(self, query, key, value, mask, *, scale):
        return reference_attention(
            query, key, value, mask.dense(), scale=scale, bias=mask.bias(),
            logit_softcap=mask.logit_softcap,
        )  # fmt: skip
