"""The engines' compiled calls: one step over every cache row, and moving a row in or out."""

from __future__ import annotations

import functools
import inspect
import weakref

import jax
import jax.numpy as jnp

from axplug.context import functional, side_inputs
from axplug.inference.constraints import allowed_tokens
from axplug.inference.sampling import penalized, sample_tokens, token_logprobs
from axplug.inference.speculation import verify_drafts
from axplug.layers.kv_cache import read_row, restart_rows, set_block_tables, write_row
from axplug.sharding import sharding_scope

__all__ = ["bind_extend_rows", "one_device_placement", "read_cache_row", "write_cache_row"]


# {model: {scope: jitted extend_rows}}: engines over one model and scope share their programs
# (an engine made again, e.g. for each round of rollouts, traces and compiles nothing new). The
# model is held weakly, by the keys and by the jitted calls, so a dead engine's model is freed.
_BOUND: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def bind_extend_rows(model, scope):
    """`extend_rows` jitted for `model` and sharding `scope`, shared by the engines over them."""
    per_scope = _BOUND.setdefault(model, {})
    if scope not in per_scope:
        call = functools.partial(_extend_rows_of, weakref.ref(model), scope)
        per_scope[scope] = jax.jit(call, static_argnums=(0, 1), donate_argnums=3)
    return per_scope[scope]


def one_device_placement(params) -> jax.sharding.NamedSharding | None:
    """Where a step over `params` on a one-device mesh returns the cache and tokens (that
    mesh, replicated), else None. An engine puts its first cache and the host's token ids
    there too: their types name the mesh after the first step, so left off it, each program
    would compile twice."""
    leaves = jax.tree.leaves(params)
    sharding = getattr(leaves[0], "sharding", None) if leaves else None
    if isinstance(sharding, jax.sharding.NamedSharding) and sharding.mesh.size == 1:
        return jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec())
    return None


def _extend_rows_of(model_ref, scope, *args):
    return extend_rows(model_ref(), scope, *args)


def extend_rows(
    model, scope, logprobs, prompt_logprobs, params, cache, ids, positions, start,
    table, last, targets, keys, counts, penalties, allowed, adapters, inserted, proposed,
    *sampling,
):  # fmt: skip
    """One call over every row: writes the new tokens to the cache, samples one per row.

    Rows where `start` >= 0 start from that length (0: empty; more: a shared cached prefix):
    a select on a [layers, rows] array, cheaper than a second decode program. Static: the
    log-probabilities to return, each None (none) or the number of top tokens N:
    `logprobs` of each row's sampled token, `prompt_logprobs` of every fed position's next
    token (`targets` [rows, width]; this needs every position's logits, not the last's only).
    `penalties` is None, or the rows' penalty state (`sampling.penalized`: token `counts` and
    `seen` [rows, vocab], kept across steps, and the rows' settings) with `output_mask` and
    `fed_mask` [rows, width]: which fed tokens are generated ones (counted) and real (seen).
    `inserted` is None, or (mask [rows, width], embeddings [rows, width, dim]) for the
    model's `extend_step` (`feeds.inserted_inputs`). `allowed` is None, or the tokens each
    row may sample ([rows, mask words], see
    `axplug.inference.constraints`; all bits set: every token). `adapters` is None, or each
    row's adapter slot [rows], which layers read as `side_input("adapter")`.
    Fed tokens are counted before sampling, so a row's last token counts from the next step
    on, when it is fed; a row starting from empty starts from zero counts. `proposed` is None,
    or (drafts [rows, K], how many are real [rows]): a row's last fed tokens are its drafts,
    verified by `verify_drafts` (rows with penalties propose none).
    Returns (tokens, accepted, scores, cache, penalty counts or None): tokens [rows] (and
    accepted None), or with `proposed` [rows, K+1] and the drafts each row accepted; scores
    holds `token` and `prompt` (logprob, rank, top ids, top logprobs), as asked.
    """
    cache = set_block_tables(restart_rows(cache, start), table)
    inputs = {"input_ids": ids, "positions": positions, "cache_state": cache}
    if inserted is not None:
        inputs["inserted"] = inserted
    width = ids.shape[1]
    all_positions = prompt_logprobs is not None
    if (
        width > 1
        and not all_positions
        and proposed is None
        and "logits_at" in inspect.signature(model.extend_step).parameters
    ):
        inputs["logits_at"] = last  # the head on each row's last token only
    with sharding_scope(scope), side_inputs(adapter=adapters):
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
    if proposed is not None:  # at each row's last token before its drafts, and each draft
        window = (last - proposed[1])[:, None] + jnp.arange(proposed[0].shape[1] + 1)[None]
        logits = jnp.take_along_axis(logits, jnp.minimum(window, width - 1)[..., None], axis=1)
    elif width > 1 and "logits_at" not in inputs:
        logits = jnp.take_along_axis(logits, last[:, None, None], axis=1)
    temperature, window, logits = sampling[0], logits, logits[:, 0]
    chosen_from, kept = logits, None
    if penalties is not None:
        rows = jnp.arange(ids.shape[0])[:, None]
        fresh = (start >= 0)[:, None]
        kept = {
            "counts": jnp.where(fresh, 0, penalties["counts"]).at[rows, ids].add(
                penalties["output_mask"]
            ),
            "seen": jnp.where(fresh, 0, penalties["seen"]).at[rows, ids].max(
                penalties["fed_mask"]
            ),
        }  # fmt: skip
        chosen_from = penalized(logits, {**penalties, **kept})
    if allowed is not None:
        chosen_from = allowed_tokens(chosen_from, allowed)

    def sampled(_):
        step_keys = jax.vmap(jax.random.fold_in)(keys, counts)
        return sample_tokens(chosen_from, step_keys, *sampling)

    def greedy(_):
        return jnp.argmax(chosen_from, axis=-1).astype(jnp.int32)

    if proposed is not None:
        chosen = window.astype(jnp.float32).at[:, 0].set(chosen_from)
        tokens, accepted = verify_drafts(chosen, *proposed, keys, counts, *sampling)
        logits = window
    else:  # every row greedy: no per-row key derivation, sort or noise at all
        tokens, accepted = jax.lax.cond(jnp.any(temperature > 0), sampled, greedy, None), None
    if logprobs is not None:
        scores["token"] = token_logprobs(logits, tokens, logprobs)
    return tokens, accepted, scores, cache, kept


@jax.jit
def read_cache_row(cache, slot):  # `slot` traced: one program for every row
    return read_row(cache, slot)


@functools.partial(jax.jit, donate_argnums=0)
def write_cache_row(cache, slot, row, table):
    return write_row(set_block_tables(cache, table), slot, row)
