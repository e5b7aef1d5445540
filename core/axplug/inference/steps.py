"""The engines' compiled calls: one step over every cache row, and moving a row in or out."""

from __future__ import annotations

import functools
import inspect

import jax
import jax.numpy as jnp

from axplug.context import functional
from axplug.inference.sampling import sample_tokens, token_logprobs
from axplug.layers.kv_cache import read_row, release_rows, set_block_tables, write_row
from axplug.sharding import sharding_scope

__all__ = ["extend_rows", "read_cache_row", "write_cache_row"]


@functools.partial(jax.jit, static_argnums=(0, 1, 2, 3, 4), donate_argnums=6)
def extend_rows(
    model, scope, resetting, logprobs, prompt_logprobs, params, cache, ids, positions, reset,
    table, last, targets, keys, counts, *sampling,
):  # fmt: skip
    """One call over every row: writes the new tokens to the cache, samples one per row.

    Static: `resetting` (some row starts from empty, so lengths are reset first), and the
    log-probabilities to return, each None (none) or the number of top tokens N:
    `logprobs` of each row's sampled token, `prompt_logprobs` of every fed position's next
    token (`targets` [rows, width]; this needs every position's logits, not the last's only).
    Returns (tokens, scores, cache); scores holds `token` and `prompt` (logprob, top ids,
    top logprobs) triples, as asked.
    """
    if resetting:
        cache = release_rows(cache, reset)
    cache = set_block_tables(cache, table)
    inputs = {"input_ids": ids, "positions": positions, "cache_state": cache}
    width = ids.shape[1]
    all_positions = prompt_logprobs is not None
    if (
        width > 1
        and not all_positions
        and "logits_at" in inspect.signature(model.extend_step).parameters
    ):
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
    scores = {}
    if all_positions:
        scores["prompt"] = token_logprobs(logits, targets, prompt_logprobs)
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
    tokens = jax.lax.cond(jnp.any(temperature > 0), sampled, greedy, None)
    if logprobs is not None:
        scores["token"] = token_logprobs(logits, tokens, logprobs)
    return tokens, scores, cache


@jax.jit
def read_cache_row(cache, slot):  # `slot` traced: one program for every row
    return read_row(cache, slot)


@functools.partial(jax.jit, donate_argnums=0)
def write_cache_row(cache, slot, row, table):
    return write_row(set_block_tables(cache, table), slot, row)
