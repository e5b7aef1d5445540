"""The Engine's `Logprob`s in the shapes of OpenAI's API (completions' `logprobs` object, chat's
`logprobs.content`) and vLLM's `prompt_logprobs`."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

from axplug.api.run import Logprob

__all__ = ["TokenTexts", "completion_logprobs", "chat_logprobs", "prompt_logprobs"]


class TokenTexts:
    """Each token id's own text (a byte-level piece that is not whole UTF-8 reads U+FFFD)."""

    def __init__(self, tokenizer: Any):
        self._tokenizer = tokenizer
        self.text = functools.lru_cache(maxsize=65536)(self._decode)

    def _decode(self, token: int) -> str:
        return self._tokenizer.decode([token])


def completion_logprobs(
    texts: TokenTexts,
    ids: Sequence[int],
    entries: Sequence[Logprob | None],
    top_n: int,
    start: int = 0,
) -> dict[str, list]:
    """Completions' `logprobs`: per token its text, logprob (None for a first prompt token),
    the `top_n` most likely texts with theirs plus the token's own (as vLLM), and its
    character offset from `start`."""
    out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [],
                            "text_offset": []}  # fmt: skip
    offset = start
    for token, entry in zip(ids, entries, strict=True):
        text = texts.text(token)
        out["tokens"].append(text)
        out["text_offset"].append(offset)
        offset += len(text)
        if entry is None:
            out["token_logprobs"].append(None)
            out["top_logprobs"].append(None)
            continue
        out["token_logprobs"].append(entry.logprob)
        top: dict[str, float] = {}
        for alternative, value in ((entry.token, entry.logprob), *entry.top[:top_n]):
            key = texts.text(alternative)  # ids spelling the same text keep the likelier
            top[key] = max(value, top.get(key, -float("inf")))
        out["top_logprobs"].append(top)
    return out


def chat_logprobs(texts: TokenTexts, entries: Sequence[Logprob], top_n: int) -> dict[str, Any]:
    """Chat's `logprobs`: `content`, one entry per token with its UTF-8 bytes and `top_n`
    alternatives."""

    def item(token: int, value: float) -> dict[str, Any]:
        text = texts.text(token)
        return {"token": text, "logprob": value, "bytes": list(text.encode())}

    content = [
        {**item(e.token, e.logprob), "top_logprobs": [item(t, v) for t, v in e.top[:top_n]]}
        for e in entries
    ]
    return {"content": content, "refusal": None}


def prompt_logprobs(
    texts: TokenTexts, entries: Sequence[Logprob | None], top_n: int
) -> list[dict[str, dict[str, Any]] | None]:
    """vLLM's `prompt_logprobs`: per prompt token None (the first) or {id: {logprob, rank,
    decoded_token}} for the token and the `top_n` most likely."""
    out: list[dict[str, dict[str, Any]] | None] = []
    for entry in entries:
        if entry is None:
            out.append(None)
            continue
        ranked = {str(entry.token): {"logprob": entry.logprob, "rank": entry.rank,
                                     "decoded_token": texts.text(entry.token)}}  # fmt: skip
        for rank, (token, value) in enumerate(entry.top[:top_n], start=1):
            ranked.setdefault(str(token), {"logprob": value, "rank": rank,
                                           "decoded_token": texts.text(token)})  # fmt: skip
        out.append(ranked)
    return out
