"""The OpenAI request bodies this server accepts (pydantic), and errors in OpenAI's shape."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

__all__ = [
    "CompletionRequest",
    "ChatCompletionRequest",
    "ChatMessage",
    "error_body",
    "validation_message",
]

_MAX_STOP = 4  # as OpenAI's API


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False


class _Sampling(BaseModel):
    """Fields shared by both endpoints; unknown fields are refused, so a typo is not ignored."""

    model_config = ConfigDict(extra="forbid")

    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=-1, description="not OpenAI's: 0 or -1 is off (as vLLM)")
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = Field(None, validate_default=True)
    seed: int | None = Field(None, ge=0, lt=2**32)
    user: str | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None

    @field_validator("n")
    @classmethod
    def _one_choice(cls, n: int) -> int:
        if n != 1:
            raise ValueError(f"only n=1 is supported, got {n}; send {n} requests instead")
        return n

    @field_validator("presence_penalty", "frequency_penalty")
    @classmethod
    def _no_penalty(cls, value: float) -> float:
        if value != 0:
            raise ValueError("repetition penalties are not supported; leave it at 0")
        return value

    @field_validator("logit_bias")
    @classmethod
    def _no_bias(cls, value: dict | None) -> dict | None:
        if value:
            raise ValueError("logit_bias is not supported")
        return value

    @field_validator("stop")
    @classmethod
    def _stops(cls, value: str | list[str] | None) -> list[str]:
        stops = [value] if isinstance(value, str) else list(value or [])
        if len(stops) > _MAX_STOP:
            raise ValueError(f"at most {_MAX_STOP} stop sequences, got {len(stops)}")
        if any(not s for s in stops):
            raise ValueError("stop sequences must not be empty")
        return stops

    @model_validator(mode="after")
    def _stream_options_need_stream(self):
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed with stream=true")
        return self


class CompletionRequest(_Sampling):
    """POST /v1/completions."""

    prompt: str | list[int] | list[str] | list[list[int]]
    echo: bool = False
    logprobs: int | None = None
    best_of: int | None = None
    suffix: str | None = None

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, prompt: Any) -> str | list[int]:
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            if len(prompt) != 1:
                raise ValueError(
                    f"one prompt per request is supported, got {len(prompt)}; send one request "
                    "per prompt"
                )
            prompt = prompt[0]
        if not prompt:
            raise ValueError("the prompt is empty")
        return prompt

    @model_validator(mode="after")
    def _unsupported(self):
        for name, value, default in (
            ("echo", self.echo, False),
            ("logprobs", self.logprobs, None),
            ("suffix", self.suffix, None),
        ):
            if value != default:
                raise ValueError(f"{name} is not supported")
        if self.best_of not in (None, 1):
            raise ValueError("best_of is not supported (only 1)")
        return self


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")

    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[dict[str, Any]]
    name: str | None = None

    @field_validator("content")
    @classmethod
    def _text(cls, content: str | list[dict[str, Any]]) -> str:
        if isinstance(content, str):
            return content
        parts = []
        for part in content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ValueError(f"only text content parts are supported, got {part.get('type')!r}")
            parts.append(part["text"])
        return "".join(parts)


class ChatCompletionRequest(_Sampling):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    response_format: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _unsupported(self):
        if self.logprobs or self.top_logprobs:
            raise ValueError("logprobs is not supported")
        if self.tools or self.tool_choice not in (None, "none"):
            raise ValueError("tools are not supported")
        if self.response_format not in (None, {"type": "text"}):
            raise ValueError("response_format: only {'type': 'text'} is supported")
        return self

    @property
    def token_limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


def error_body(message: str, kind: str, param: str | None = None, code: str | None = None):
    """An error in the shape OpenAI's API (and its clients) use."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def validation_message(errors: list[dict[str, Any]]) -> tuple[str, str | None]:
    """One message for pydantic's errors (`field: problem; ...`) and the first bad field."""
    parts, param = [], None
    for err in errors:
        loc = [str(p) for p in err.get("loc", ()) if p != "body"]
        # pydantic names the union member it tried (`str`, `list[int]`): not the user's field.
        loc = [p for p in loc if not any(c in p for c in "[]") and p not in ("str", "int")]
        field = ".".join(loc)
        message = str(err.get("msg", "invalid")).removeprefix("Value error, ")
        parts.append(f"{field}: {message}" if field else message)
        param = param or (field or None)
    return "; ".join(dict.fromkeys(parts)), param
