"""Chat templates (Hugging Face's Jinja format) rendered in a sandbox, found beside a tokenizer."""

from __future__ import annotations

import json
import pathlib
from typing import Any

__all__ = ["ChatTemplate", "DEFAULT_CHAT_TEMPLATE"]

# For models without a chat template of their own (a model trained from scratch on text).
DEFAULT_CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message.role }}: {{ message.content }}\n\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


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

    def render(self, messages: list[dict[str, Any]], *, add_generation_prompt: bool = True) -> str:
        """The text of `messages`; with `add_generation_prompt` (a prompt), ending where the
        assistant's reply starts."""
        from jinja2.exceptions import TemplateError

        try:
            return self._template.render(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
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
