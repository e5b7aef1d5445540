"""Speculative decoding: a proposer guesses each decoding row's next tokens, and one step of
the target model verifies them all (Leviathan et al. 2023, Chen et al. 2023)."""

from __future__ import annotations

import abc
from typing import Any

import jax
import jax.numpy as jnp

from axplug.config import Configurable, config_class
from axplug.inference.sampling import filtered_logits

__all__ = ["Proposer", "propose", "verify_drafts"]


class Proposer(Configurable, abc.ABC):
    """An `axplug.proposers` entry: up to `num_tokens` guesses of each decoding row's next
    tokens (`Engine(speculative="NAME:key=value,...")`). Proposals are point guesses: the
    verification accepts each with the target's probability of it, so the output follows the
    target's distribution whatever the proposer (and equals plain decoding when greedy)."""

    @config_class
    class Config(Configurable.Config):
        num_tokens: int = 4  # proposed tokens per row and step

    @classmethod
    def check_config(cls, cfg: Any) -> None:
        if not (isinstance(cfg.num_tokens, int) and cfg.num_tokens >= 1):
            raise cfg.field_error("num_tokens", f"must be an integer >= 1, not {cfg.num_tokens!r}")

    def bind(self, engine: Any) -> None:  # noqa: B027 (optional)
        """Called once by the Engine that verifies the proposals (its `max_len`, `vocab_size`)."""

    @abc.abstractmethod
    def propose(self, contexts: dict[int, list[int]], limits: dict[int, int]) -> dict[int, list]:
        """Up to `limits[row]` tokens to follow each row's context (prompt and output)."""


def propose(proposer: Proposer, rows: list, num_drafts: int, max_len: int) -> dict[int, list]:
    """`proposer`'s drafts for the decoding `rows` (by slot) without penalties or a
    constraint, each at most what the row may still generate after the step's own token and
    what its row can hold."""
    limits = {}
    for s, active in enumerate(rows):
        if active is None or active.request.constraint is not None:
            continue
        if active.decoding and not active.request.sampling.penalizes:
            left = active.request.sampling.max_new_tokens - len(active.output) - 1
            if (limit := min(num_drafts, left, max_len - active.context_len)) > 0:
                limits[s] = limit
    proposed = proposer.propose({s: rows[s].context for s in limits}, limits)
    return {s: [int(t) for t in d[: limits[s]]] for s, d in proposed.items() if len(d)}


def verify_drafts(logits, drafts, counts_proposed, keys, counts, temperature, *cuts):
    """The tokens each row emits, and how many of its drafts it accepted.

    `logits` [b, K+1, vocab] are the target's at a row's last token and at each of its
    `drafts` [b, K] (the first `counts_proposed` [b] real). Greedy rows accept drafts while
    they equal the argmax; sampled rows accept a draft with the probability the row's
    distribution (temperature and `cuts`: top-k, top-p, min-p) gives it, and after a rejection
    sample from that distribution without the rejected token (the residual of a point
    proposal), else from the last position's. Returns (tokens [b, K+1], accepted [b]): a row
    emits `tokens[:accepted + 1]`. Token i's keys derive from `fold_in(key, counts + i)`, so a
    row without drafts samples exactly as plain decoding does."""
    b, width, vocab = logits.shape
    logits = logits.astype(jnp.float32)
    argmax = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    real = jnp.arange(width - 1)[None] < counts_proposed[:, None]
    rows = jnp.arange(b)

    def accepted_from(ok):
        return jnp.sum(jnp.cumprod(ok & real, axis=1), axis=1)

    def sampled(_):
        flat = filtered_logits(logits.reshape(b * width, vocab), *(
            jnp.repeat(a, width) for a in (temperature, *cuts)))  # fmt: skip
        filtered = flat.reshape(b, width, vocab)
        p = jnp.take_along_axis(jax.nn.softmax(filtered[:, :-1]), drafts[..., None], -1)[..., 0]
        step = counts[:, None] + jnp.arange(width - 1)[None]
        draw = jax.vmap(jax.vmap(lambda k, c: jax.random.uniform(jax.random.fold_in(
            jax.random.fold_in(k, c), 1)), in_axes=(None, 0)))(keys, step)  # fmt: skip
        greedy = temperature[:, None] == 0
        accepted = accepted_from(jnp.where(greedy, drafts == argmax[:, :-1], draw < p))
        last = filtered[rows, accepted]
        rejected = drafts[rows, jnp.minimum(accepted, width - 2)]
        cut = (accepted < counts_proposed)[:, None] & (jnp.arange(vocab) == rejected[:, None])
        final_keys = jax.vmap(jax.random.fold_in)(keys, counts + accepted)
        token = jax.vmap(jax.random.categorical)(final_keys, jnp.where(cut, -jnp.inf, last))
        return accepted, jnp.where(temperature > 0, token, argmax[rows, accepted])

    def greedy(_):
        accepted = accepted_from(drafts == argmax[:, :-1])
        return accepted, argmax[rows, accepted]

    accepted, final = jax.lax.cond(jnp.any(temperature > 0), sampled, greedy, None)
    drafted = jnp.pad(drafts, ((0, 0), (0, 1)))
    tokens = jnp.where(jnp.arange(width)[None] < accepted[:, None], drafted, 0)
    return tokens.at[rows, accepted].set(final.astype(jnp.int32)), accepted
