"""The engines' compiled calls: one step over every cache row, and moving a row in or out."""

from __future__ import annotations

import functools
import inspect

import jax
import jax.numpy as jnp

from axplug.context import functional
from axplug.inference.sampling import sample_tokens
from axplug.layers.kv_cache import read_row, release_rows, set_block_tables, write_row
from axplug.sharding import sharding_scope

__all__ = ["extend_rows", "read_cache_row", "write_cache_row"]


@functools.partial(jax.jit, static_argnums=(0, 1, 2), donate_argnums=4)
def extend_rows(
    model, scope, resetting, params, cache, ids, positions, reset, table, last, keys, counts,
    *sampling,
):  # fmt: skip
    """One call over every row: writes the new tokens to the cache, samples one per row.
    `resetting` (static): some row starts from empty, so lengths are reset first."""
    if resetting:
        cache = release_rows(cache, reset)
    cache = set_block_tables(cache, table)
    inputs = {"input_ids": ids, "positions": positions, "cache_state": cache}
    width = ids.shape[1]
    if width > 1 and "logits_at" in inspect.signature(model.extend_step).parameters:
        inputs["logits_at"] = last  # the head on each row's last token only
    with sharding_scope(scope):
        (logits, cache), _ = functional(
            model,
            prng_key=None,
            state=params,
            inputs=inputs,
            is_training=False,
            method="extend_step",
        )
    if width > 1 and "logits_at" not in inputs:
        logits = jnp.take_along_axis(logits, last[:, None, None], axis=1)
    logits = logits[:, 0]
    temperature = sampling[0]

    def sampled(_):
        step_keys = jax.vmap(jax.random.fold_in)(keys, counts)
        return sample_tokens(logits, step_keys, *sampling)

    def greedy(_):
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)

    # Every row greedy: no per-row key derivation, sort or noise at all.
    return jax.lax.cond(jnp.any(temperature > 0), sampled, greedy, None), cache


@jax.jit
def read_cache_row(cache, slot):  # `slot` traced: one program for every row
    return read_row(cache, slot)


@functools.partial(jax.jit, donate_argnums=0)
def write_cache_row(cache, slot, row, table):
    return write_row(set_block_tables(cache, table), slot, row)
