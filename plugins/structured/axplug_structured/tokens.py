"""llguidance's view of an axplug tokenizer: every token's bytes and the end-of-text token."""

from __future__ import annotations

from typing import Any

import llguidance

from axplug.api.data import ByteTokenizer

__all__ = ["llg_tokenizer"]


class _ByteTokens:
    """The byte tokenizer as llguidance's `TokenizerWrapper` reads it: ids 0-255 are the
    bytes, ids up to the model's vocabulary are tokens that never match, and the last is the
    end of text (the byte tokenizer has none: it is outside the model's vocabulary, so a
    constrained output ends where its grammar does)."""

    bos_token_id = None

    def __init__(self, vocab_size: int):
        self.tokens = [bytes([i]) for i in range(256)] + [b""] * (vocab_size - 256) + [b"\0"]
        self.eos_token_id = vocab_size
        self.special_token_ids = list(range(256, vocab_size + 1))

    def __call__(self, text: str | bytes) -> list[int]:
        return list(text if isinstance(text, bytes) else text.encode("utf-8"))


def llg_tokenizer(tokenizer: Any, vocab_size: int) -> llguidance.LLTokenizer:
    """`tokenizer` (the byte tokenizer, or one read from a Hugging Face `tokenizer.json`) for
    a model of `vocab_size` tokens; a ValueError names any other kind."""
    if isinstance(tokenizer, ByteTokenizer):
        return llguidance.LLTokenizer(llguidance.TokenizerWrapper(_ByteTokens(vocab_size)))
    source = getattr(tokenizer, "source", None)
    if source is not None and source.name == "tokenizer.json":
        eos = tokenizer.eos_id
        if eos is None:  # one past the model's tokens: never sampled
            return llguidance.LLTokenizer(source.read_text(), n_vocab=vocab_size + 1,
                                          eos_token=vocab_size)  # fmt: skip
        return llguidance.LLTokenizer(source.read_text(), n_vocab=vocab_size, eos_token=eos)
    raise ValueError(
        f"structured outputs need the byte tokenizer or a Hugging Face tokenizer.json; this "
        f"model's is {type(tokenizer).__name__} ({tokenizer.describe()})"
    )
