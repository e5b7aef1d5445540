"""Chat templates (Hugging Face's Jinja format) rendered in a sandbox, found beside a tokenizer."""

from __future__ import annotations

import json
import pathlib
import threading
import time
from typing import Any

__all__ = ["ChatTemplate", "DEFAULT_CHAT_TEMPLATE", "RENDER_SECONDS", "MAX_RANGE"]

# A template is code that came with a model: one render may take this long, and a loop over
# `range` this many items, before it is stopped (a template looping for minutes would hold a
# serving worker after its client left, or stall prepare-chat).
RENDER_SECONDS = 5.0
MAX_RANGE = 100_000


class _Deadline(threading.local):
    at = float("inf")  # when this thread's render must end


_deadline = _Deadline()

# For models without a chat template of their own (a model trained from scratch on text):
# `role: content` paragraphs; tools (when given) first, an assistant's tool calls in Hermes'
# `<tool_call>` blocks (axplug-serve's default tool parser reads them back). The environment
# trims the newline after a block tag, as Hugging Face's does: newlines follow `}}`.
DEFAULT_CHAT_TEMPLATE = (
    "{% if tools %}tools: {{ tools | tojson }}\n\n{% endif %}"
    "{% for message in messages %}{{ message.role }}: "
    "{% if message.content %}{{ message.content }}{% endif %}"
    "{% for call in message.tool_calls or [] %}"
    "<tool_call>\n{{ call.function | tojson }}\n</tool_call>{% endfor %}{{ '\\n\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


class ChatTemplate:
    """A Jinja chat template (Hugging Face's format), rendered in a sandbox: templates come
    with downloaded models, so they may not reach Python objects."""

    def __init__(
        self, source: str, *, bos_token: str = "", eos_token: str = "", origin: str = "given"
    ):
        from jinja2.exceptions import TemplateError

        env = _environment()
        env.globals["raise_exception"] = _raise_template_error
        env.globals["range"] = _budgeted_range
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

    def render(
        self,
        messages: list[dict[str, Any]],
        *,
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
    ) -> str:
        """The text of `messages`; with `add_generation_prompt` (a prompt), ending where the
        assistant's reply starts. `tools` (OpenAI's function dicts) reach the template as
        transformers' `apply_chat_template(tools=)` gives them."""
        from jinja2.exceptions import TemplateError

        _deadline.at = time.monotonic() + RENDER_SECONDS
        try:
            return self._template.render(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                tools=tools,
                bos_token=self.bos_token,
                eos_token=self.eos_token,
            )
        except (TemplateError, OverflowError, RecursionError, MemoryError) as exc:
            what = str(exc) or type(exc).__name__
            raise ValueError(f"messages: the model's chat template refused them: {what}") from None
        finally:
            _deadline.at = float("inf")


def _environment() -> Any:
    """A sandbox whose every call and `range` step checks the render's time budget."""
    from jinja2.exceptions import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Budgeted(ImmutableSandboxedEnvironment):
        intercepted_binops = frozenset({"*"})

        def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 - jinja's signature
            _check_deadline()
            return super().call(__context, __obj, *args, **kwargs)

        def call_binop(self, context, operator, left, right):
            sizes = [len(x) for x in (left, right) if isinstance(x, (str, list, tuple))]
            times = [x for x in (left, right) if isinstance(x, int)]
            if sizes and times and sizes[0] * times[0] > 10 * MAX_RANGE:
                raise TemplateError(f"a sequence repeated to {sizes[0] * times[0]} items")
            return super().call_binop(context, operator, left, right)

    return Budgeted(trim_blocks=True, lstrip_blocks=True)


def _check_deadline() -> None:
    from jinja2.exceptions import TemplateError

    if time.monotonic() > _deadline.at:
        raise TemplateError(f"rendering took over {RENDER_SECONDS:g} s (a template loops too long)")


def _budgeted_range(*args: int) -> list[int]:
    """`range` for templates: at most MAX_RANGE items (a loop's calls check the time)."""
    from jinja2.exceptions import TemplateError

    items = range(*args)
    if len(items) > MAX_RANGE:
        raise TemplateError(f"range of {len(items)} items (at most {MAX_RANGE})")
    return list(items)


def _raise_template_error(message: str) -> None:
    from jinja2.exceptions import TemplateError

    raise TemplateError(message)


def _token_text(value: Any) -> str:
    """A special token as tokenizer_config.json spells it: a string or {"content": ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else ""
