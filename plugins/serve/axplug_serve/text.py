"""Token ids to streamed text (stop strings, partial characters); chat prompts to text with
axplug-chat's `ChatTemplate`."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from axplug_chat import DEFAULT_CHAT_TEMPLATE, ChatTemplate

__all__ = ["TextStream", "ChatTemplate", "DEFAULT_CHAT_TEMPLATE"]

# Prompt tokens decoded with the output, so a token's leading space or merge with its left
# neighbour (SentencePiece, byte-level BPE) comes out as it would in the full text.
_CONTEXT_TOKENS = 8


class TextStream:
    """The text of a growing list of output tokens, released once it is final.

    Text is held back while it ends in a partial UTF-8 character or could be the start of a
    stop string; when a stop string appears the text ends before it and `stopped` is set.
    """

    def __init__(self, tokenizer: Any, prompt_ids: Sequence[int], stop: Sequence[str] = ()):
        self._tokenizer = tokenizer
        self._context = list(prompt_ids[-_CONTEXT_TOKENS:])
        self._offset = len(tokenizer.decode(self._context))
        self._ids: list[int] = []
        self._stop = [s for s in stop if s]
        self._sent = 0
        self.text = ""
        self.stopped = False

    def push(self, token: int) -> str:
        """Adds a token; returns the text that became final (maybe "")."""
        self._ids.append(token)
        text = self._decode()
        if text.endswith("\ufffd"):  # a character still being spelled out in bytes
            return ""
        return self._release(text)

    def flush(self) -> str:
        """The text still held back, at the end of generation."""
        if self.stopped:
            return ""
        self.text = self._decode()
        out, self._sent = self.text[self._sent :], len(self.text)
        return out

    def _decode(self) -> str:
        return self._tokenizer.decode(self._context + self._ids)[self._offset :]

    def _release(self, text: str) -> str:
        hits = [i for i in (text.find(s, self._sent) for s in self._stop) if i >= 0]
        if hits:
            text, self.stopped = text[: min(hits)], True
            self.text, end = text, len(text)
        else:
            self.text, end = text, len(text) - self._held(text)
        out, self._sent = text[self._sent : end], max(self._sent, end)
        return out

    def _held(self, text: str) -> int:
        """How many trailing characters could begin a stop string."""
        for k in range(min(len(text), max((len(s) for s in self._stop), default=1) - 1), 0, -1):
            if any(s.startswith(text[-k:]) for s in self._stop):
                return k
        return 0
