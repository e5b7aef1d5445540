"""The OpenAI request bodies this server accepts (pydantic), and errors in OpenAI's shape."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

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
    """Fields shared by both endpoints; unknown fields are refused, so a typo is not ignored.
    An explicit `null` means the default, as in OpenAI's API."""

    model_config = ConfigDict(extra="forbid")

    model: str
    max_tokens: int | None = Field(None, ge=1, strict=True)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=-1, strict=True, description="not OpenAI's: 0 or -1 is off")
    n: int = Field(1, strict=True)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = Field(None, validate_default=True)
    seed: int | None = Field(None, ge=0, lt=2**32, strict=True)
    user: str | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    # Accepted and ignored: bookkeeping some clients always send.
    store: bool | None = None
    metadata: dict[str, Any] | None = None
    service_tier: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _nulls_mean_defaults(cls, data: Any) -> Any:
        if isinstance(data, dict):
            return {key: value for key, value in data.items() if value is not None}
        return data

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

    @field_validator("stream_options")
    @classmethod
    def _stream_options_need_stream(cls, value, info: ValidationInfo):
        if value is not None and not info.data.get("stream"):
            raise ValueError("only allowed with stream=true")
        return value


def _unsupported(*names: str, allowed: tuple = (None, False)):
    """A validator refusing any value of `names` but `allowed` (the error names the field)."""

    def check(cls, value):
        if value not in allowed:
            raise ValueError("not supported by this server")
        return value

    return field_validator(*names)(classmethod(check))


class CompletionRequest(_Sampling):
    """POST /v1/completions."""

    prompt: str | list[int] | list[str] | list[list[int]]
    echo: bool = False
    logprobs: int | None = None
    best_of: int | None = None
    suffix: str | None = None

    _refused = _unsupported("echo", "logprobs", "suffix")
    _one_best = _unsupported("best_of", allowed=(None, 1))

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
    max_completion_tokens: int | None = Field(None, ge=1, strict=True)
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None  # accepted: no tools run anyway
    response_format: dict[str, Any] | None = None

    _refused = _unsupported("logprobs", "top_logprobs", "tools")
    _no_tool_choice = _unsupported("tool_choice", allowed=(None, "none"))
    _text_format = _unsupported("response_format", allowed=(None, {"type": "text"}))

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
        if err.get("type") == "json_invalid":  # loc is ("body", character offset)
            at = err.get("loc", ("body", "?"))[-1]
            parts.append(f"the request body is not valid JSON (at character {at}): "
                         f"{err.get('ctx', {}).get('error', err.get('msg'))}")  # fmt: skip
            continue
        loc = [str(p) for p in err.get("loc", ()) if p != "body"]
        # pydantic names the union member it tried (`str`, `list[int]`): not the user's field.
        loc = [p for p in loc if not any(c in p for c in "[]") and p not in ("str", "int")]
        field = ".".join(loc)
        message = str(err.get("msg", "invalid")).removeprefix("Value error, ")
        parts.append(f"{field}: {message}" if field else message)
        param = param or (field or None)
    return "; ".join(dict.fromkeys(parts)), param
