"""Token ids to streamed text (stop strings, partial characters) and chat prompts to text."""

from __future__ import annotations

import json
import pathlib
from collections.abc import Sequence
from typing import Any

__all__ = ["TextStream", "ChatTemplate", "DEFAULT_CHAT_TEMPLATE"]

# Prompt tokens decoded with the output, so a token's leading space or merge with its left
# neighbour (SentencePiece, byte-level BPE) comes out as it would in the full text.
_CONTEXT_TOKENS = 8

# For models without a chat template of their own (a model trained from scratch on text).
DEFAULT_CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message.role }}: {{ message.content }}\n\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


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


class ChatTemplate:
    """A Jinja chat template (Hugging Face's format), rendered in a sandbox: templates come
    with downloaded models, so they may not reach Python objects."""

    def __init__(
        self, source: str, *, bos_token: str = "", eos_token: str = "", origin: str = "given"
    ):
        from jinja2.exceptions import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise_template_error
        try:
            self._template = env.from_string(source)
        except TemplateError as exc:
            raise ValueError(f"the chat template does not parse: {exc}") from None
        self.source, self.bos_token, self.eos_token = source, bos_token, eos_token
        self.origin = origin  # where the template came from, for the banner and model card

    @classmethod
    def for_tokenizer(cls, tokenizer: Any, explicit: str | None = None) -> ChatTemplate:
        """`explicit` (a file), else the tokenizer's own (its tokenizer_config.json's
        `chat_template`, or chat_template.jinja beside it), else `DEFAULT_CHAT_TEMPLATE`."""
        source_path = getattr(tokenizer, "source", None)
        folder = pathlib.Path(source_path).parent if source_path else None
        config = {}
        if folder is not None and (folder / "tokenizer_config.json").is_file():
            config = json.loads((folder / "tokenizer_config.json").read_text())
        tokens = {k: _token_text(config.get(k)) for k in ("bos_token", "eos_token")}
        if explicit is not None:
            return cls(pathlib.Path(explicit).read_text(), **tokens, origin=str(explicit))
        source, origin = config.get("chat_template"), f"{folder}/tokenizer_config.json"
        if isinstance(source, list):  # named templates: the default one
            named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
            source = named.get("default") or next(iter(named.values()), None)
        if not source and folder is not None and (folder / "chat_template.jinja").is_file():
            source = (folder / "chat_template.jinja").read_text()
            origin = str(folder / "chat_template.jinja")
        if not source:
            return cls(DEFAULT_CHAT_TEMPLATE, **tokens, origin="default (role: content lines)")
        return cls(source, **tokens, origin=origin)

    def render(self, messages: list[dict[str, Any]]) -> str:
        """The prompt text for `messages`, ending where the assistant's reply starts."""
        from jinja2.exceptions import TemplateError

        try:
            return self._template.render(
                messages=messages,
                add_generation_prompt=True,
                bos_token=self.bos_token,
                eos_token=self.eos_token,
            )
        except TemplateError as exc:
            raise ValueError(f"messages: the model's chat template refused them: {exc}") from None


def _raise_template_error(message: str) -> None:
    from jinja2.exceptions import TemplateError

    raise TemplateError(message)


def _token_text(value: Any) -> str:
    """A special token as tokenizer_config.json spells it: a string or {"content": ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else ""
