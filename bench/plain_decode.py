"""A plain-JAX greedy decoder of a `bench/plain_llama.py` model: the reference for decoding.

One jitted function per call shape, a per-layer KV cache ([batch, max_len, kv_heads,
head_dim], or head-major [batch, kv_heads, max_len, head_dim] with `head_major=True`, the
layout whose attention dots need no transposed copy on XLA:CPU), every row at the same position
(a batch of equal-length prompts), no scheduler, each token read back to the host (as a
decoder that stops at an end-of-sequence token must): what an inference engine is measured
against.
"""

from __future__ import annotations

import functools
import math
import time

import jax
import jax.numpy as jnp
import numpy as np
from plain_llama import NEG_INF, ModelSpec, _c, _mlp, _norm, apply_rope, rope_tables

__all__ = ["PlainDecoder"]


class PlainDecoder:
    """Greedy decoding of `params` (plain_llama layout) with a KV cache of `max_len` tokens."""

    def __init__(self, spec: ModelSpec, params, max_len: int, *, head_major: bool = False):
        if spec.experts:
            raise ValueError("the plain decoder covers dense models only")
        self.spec, self.params, self.max_len = spec, params, max_len
        self.head_major = head_major

    def init_cache(self, batch: int):
        hd = self.spec.dim // self.spec.heads
        shape = (batch, self.max_len, self.spec.heads, hd)
        if self.head_major:
            shape = (batch, self.spec.heads, self.max_len, hd)
        dtype = self.spec.compute_dtype
        return [(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype)) for _ in range(self.spec.layers)]

    def generate(self, prompts: jax.Array, new_tokens: int) -> tuple[list[list[int]], float, float]:
        """Greedy ids [batch][new_tokens] for equal-length `prompts`; prefill and decode seconds."""
        cache = jax.block_until_ready(self.init_cache(prompts.shape[0]))  # as the Engine's
        start = time.perf_counter()
        token, cache = _step(self.spec, self.max_len, self.head_major, self.params, cache,
                             prompts, 0)  # fmt: skip
        token.block_until_ready()
        prefill = time.perf_counter() - start
        out = [np.asarray(token)]
        position = prompts.shape[1]
        start = time.perf_counter()
        for _ in range(new_tokens - 1):
            token, cache = _step(
                self.spec, self.max_len, self.head_major, self.params, cache, token[:, None],
                position,
            )  # fmt: skip
            # Read each token, as a decoder that stops at an end-of-sequence token must.
            out.append(np.asarray(token))
            position += 1
        return np.stack(out, axis=1).tolist(), prefill, time.perf_counter() - start


@functools.partial(jax.jit, static_argnums=(0, 1, 2), donate_argnums=4)
def _step(spec: ModelSpec, max_len: int, head_major: bool, params, cache, ids, start):
    """Writes `ids` [b, s] at positions start.. to the cache; the greedy next token [b]."""
    b, s = ids.shape
    hd = spec.dim // spec.heads
    positions = start + jnp.arange(s, dtype=jnp.int32)
    rope = None
    if spec.rope_theta:
        cos, sin = rope_tables(max_len, hd, spec.rope_theta)
        rope = (
            jax.lax.dynamic_slice_in_dim(cos, start, s, axis=1),
            jax.lax.dynamic_slice_in_dim(sin, start, s, axis=1),
        )
    mask = jnp.arange(max_len)[None, :] <= positions[:, None]  # [s, max_len]
    x = jnp.take(_c(params["embed"], spec), ids, axis=0)
    new_cache = []
    for p, (k_cache, v_cache) in zip(params["layers"], cache, strict=True):
        h = _norm(x, p["attn_norm"], spec)
        q, k, v = (
            jnp.einsum("bsd,de->bse", h, _c(p[w], spec)).reshape(b, s, spec.heads, hd)
            for w in ("wq", "wk", "wv")
        )
        if rope is not None:
            q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        if head_major:
            k, v, at, kv = (
                k.transpose(0, 2, 1, 3),
                v.transpose(0, 2, 1, 3),
                (0, 0, start, 0),
                "bhkd",
            )
        else:
            at, kv = (0, start, 0, 0), "bkhd"
        k_cache = jax.lax.dynamic_update_slice(k_cache, k.astype(k_cache.dtype), at)
        v_cache = jax.lax.dynamic_update_slice(v_cache, v.astype(v_cache.dtype), at)
        new_cache.append((k_cache, v_cache))
        logits = jnp.einsum(f"bqhd,{kv}->bhqk", q, k_cache, preferred_element_type=jnp.float32)
        logits = jnp.where(mask, logits * (1.0 / math.sqrt(hd)), NEG_INF)
        probs = jax.nn.softmax(logits, axis=-1).astype(v_cache.dtype)
        out = jnp.einsum(f"bhqk,{kv}->bqhd", probs, v_cache).reshape(b, s, spec.dim)
        x = x + jnp.einsum("bse,ed->bsd", out, _c(p["wo"], spec))
        x = x + _mlp(p, _norm(x, p["mlp_norm"], spec), spec).astype(x.dtype)
    x = _norm(x[:, -1], params["final_norm"], spec)
    head = params["embed"].T if spec.tie_embeddings else params["lm_head"]
    logits = jnp.einsum("bd,dv->bv", x, _c(head, spec))
    return jnp.argmax(logits, axis=-1).astype(jnp.int32), new_cache
