"""Constrained decoding: a request's `TokenConstraint` says which tokens it may sample next
(text matching a JSON schema, a regular expression, one of a few choices); a `Guide` (an
`axplug.guides` entry) compiles such a spec for a tokenizer."""

from __future__ import annotations

import abc
from collections.abc import Callable
from typing import Any

import numpy as np

from axplug.config import Configurable

__all__ = ["Guide", "TokenConstraint", "allowed_tokens", "mask_words"]


class TokenConstraint(abc.ABC):
    """What one request may generate. Before each step that samples a token for the request
    the engine asks for the allowed tokens, and after it tells the constraint the token."""

    @abc.abstractmethod
    def fill(self, words: np.ndarray) -> None:
        """Writes the allowed next tokens into `words` (int32 [ceil(vocab / 32)]): bit
        `t % 32` of `words[t // 32]` is set iff token t may come next."""

    @abc.abstractmethod
    def accept(self, token: int) -> bool:
        """Records the sampled `token` (one `fill` allowed); True when nothing may follow it:
        the request stops there."""


class Guide(Configurable, abc.ABC):
    """An `axplug.guides` entry: compiles constraint specs for one tokenizer. `kinds` are the
    spec kinds it compiles: `json_schema` (a schema dict), `json_object` (any JSON object),
    `regex` (a pattern), `choice` (a list of strings), `grammar` (grammar text)."""

    kinds: tuple[str, ...] = ()

    @abc.abstractmethod
    def bind(self, tokenizer: Any, vocab_size: int) -> None:
        """Called once, before `compile`, with the model's tokenizer (`axplug.api.data`'s
        `Tokenizer`) and its vocabulary size (at least the tokenizer's)."""

    @abc.abstractmethod
    def compile(self, kind: str, spec: Any) -> Callable[[], TokenConstraint]:
        """A maker of fresh constraints for `spec` (one per request or choice); raises
        ValueError saying what is wrong with the spec."""


def mask_words(vocab_size: int) -> int:
    """int32 words of a token mask over `vocab_size` tokens."""
    return (vocab_size + 31) // 32


def allowed_tokens(logits, words):
    """`logits` [b, vocab] with the tokens `words` [b, mask_words(vocab)] does not allow at
    -inf (an all-ones row allows every token)."""
    import jax.numpy as jnp

    ids = jnp.arange(logits.shape[-1])
    bits = (words[:, ids // 32] >> (ids % 32)) & 1
    return jnp.where(bits == 1, logits.astype(jnp.float32), -jnp.inf)
