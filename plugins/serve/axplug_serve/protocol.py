"""The OpenAI request bodies this server accepts (pydantic), and errors in OpenAI's shape.

Unknown fields are accepted (as vLLM does) and listed in `model_extra`: the server logs each
name once, or refuses them with `--strict-fields`. Every number that reaches an array is
bounded here, and text must be valid Unicode (no lone UTF-16 surrogates).
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Sequence
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from axplug.api import AxplugError
from axplug.api.run import SamplingParams
from axplug_serve.images import content_images, content_parts, content_text

__all__ = [
    "CompletionRequest",
    "ChatCompletionRequest",
    "ChatMessage",
    "TokenizeRequest",
    "DetokenizeRequest",
    "APIError",
    "check_ids",
    "invalid",
    "error_body",
    "validation_message",
]

_MAX_STOP = 4  # as OpenAI's API
MAX_N = 16  # choices per request
MAX_PROMPTS = 64  # prompts in one /v1/completions request
MAX_LOGPROBS = 20  # top tokens per position, as OpenAI's API and vLLM
_INT32_MAX = 2**31 - 1


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")
    include_usage: bool = False


def _lone_surrogate(value: Any, path: str = "") -> str | None:
    """The path of the first string in `value` that is not valid Unicode, else None."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as exc:
            return f"{path or 'body'} (character {exc.start})"
        return None
    if isinstance(value, (dict, list)):
        items = value.items() if isinstance(value, dict) else enumerate(value)
        for key, item in items:
            if found := _lone_surrogate(item, f"{path}.{key}" if path else str(key)):
                return found
    return None


class _Sampling(BaseModel):
    """Fields shared by both endpoints. An explicit `null` means the default, as in OpenAI's
    API; unknown fields land in `model_extra`."""

    model_config = ConfigDict(extra="allow")

    model: str
    max_tokens: int | None = Field(None, ge=0, le=_INT32_MAX, strict=True)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(
        0, ge=-1, le=_INT32_MAX, strict=True, description="vLLM's extension: 0 or -1 is off"
    )
    min_p: float = Field(0.0, ge=0.0, le=1.0, description="vLLM's extension: 0 is off")
    n: int = Field(1, ge=1, le=MAX_N, strict=True)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = Field(None, validate_default=True)
    stop_token_ids: list[int] = Field(
        [], max_length=64, description="vLLM's extension: more ids that end generation"
    )
    ignore_eos: bool = Field(False, description="vLLM's extension: go on past the model's EOS")
    seed: int | None = Field(None, ge=0, lt=2**32, strict=True)
    user: str | None = None
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(
        1.0, gt=0.0, le=100.0, description="vLLM's extension: 1 is off"
    )
    logit_bias: dict[str, float] | None = Field(
        None, max_length=1024, description="token id (a string) -> bias in [-100, 100]"
    )
    # Structured outputs (axplug_serve.guided): OpenAI's, and vLLM's extensions.
    response_format: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = Field(None, max_length=16_384)
    guided_choice: list[str] | None = Field(None, min_length=1, max_length=1024)
    guided_grammar: str | None = Field(None, max_length=65_536)
    # Accepted and ignored: bookkeeping some clients always send.
    store: bool | None = None
    metadata: dict[str, Any] | None = None
    service_tier: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _nulls_mean_defaults(cls, data: Any) -> Any:
        if isinstance(data, dict):
            if where := _lone_surrogate(data):
                raise ValueError(
                    f"{where}: not valid Unicode (a lone UTF-16 surrogate); send UTF-8 text"
                )
            return {key: value for key, value in data.items() if value is not None}
        return data

    @field_validator("logit_bias")
    @classmethod
    def _bias(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        for token, bias in (value or {}).items():
            if not token.isdigit() or int(token) > _INT32_MAX:
                raise ValueError(f"key {token[:20]!r} is not a token id")
            if not -100.0 <= bias <= 100.0:
                raise ValueError(f"the bias of token {token} must be in [-100, 100], got {bias}")
        return value

    @field_validator("stop_token_ids")
    @classmethod
    def _ids(cls, ids: list[int]) -> list[int]:
        if bad := [t for t in ids if not 0 <= t <= _INT32_MAX]:
            raise ValueError(f"token id {bad[0]} is not a token id")
        return ids

    @field_validator("stop")
    @classmethod
    def _stops(cls, value: str | list[str] | None) -> list[str]:
        stops = [value] if isinstance(value, str) else list(value or [])
        if len(stops) > _MAX_STOP:
            raise ValueError(f"at most {_MAX_STOP} stop sequences, got {len(stops)}")
        if any(not s for s in stops):
            raise ValueError("stop sequences must not be empty")
        return stops

    def sampling_params(
        self, max_new_tokens: int, stop_tokens: tuple[int, ...], seed: int,
        logprobs: int | None, prompt_logprobs: int | None,
    ) -> SamplingParams:  # fmt: skip
        """The engine's sampling settings for this body."""
        return SamplingParams(
            max_new_tokens=max_new_tokens, temperature=self.temperature,
            top_k=max(self.top_k, 0), top_p=self.top_p, min_p=self.min_p,
            presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty,
            logit_bias=tuple((int(t), b) for t, b in (self.logit_bias or {}).items()),
            stop_tokens=stop_tokens, seed=seed, logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
        )  # fmt: skip

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
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS, strict=True)
    prompt_logprobs: int | None = Field(
        None, ge=0, le=MAX_LOGPROBS, strict=True, description="vLLM's extension"
    )
    best_of: int | None = None
    suffix: str | None = None

    _refused = _unsupported("suffix")
    _one_best = _unsupported("best_of", allowed=(None, 1))

    @field_validator("prompt")
    @classmethod
    def _prompts(cls, prompt: Any) -> list[str] | list[list[int]]:
        """One prompt (text or ids) or a list of them: always a list here."""
        prompts = prompt if isinstance(prompt, list) and prompt and not isinstance(
            prompt[0], int
        ) else [prompt]  # fmt: skip
        if len(prompts) > MAX_PROMPTS:
            raise ValueError(f"at most {MAX_PROMPTS} prompts per request, got {len(prompts)}")
        for one in prompts:
            if not one:
                raise ValueError("the prompt is empty")
            if isinstance(one, list) and (bad := [t for t in one if not 0 <= t <= _INT32_MAX]):
                raise ValueError(f"token id {bad[0]} is not a token id")
        return prompts

    @property
    def prompts(self) -> list[str | list[int]]:
        """The prompts as the validator left them: a list of texts or of token-id lists."""
        return self.prompt  # type: ignore[return-value]


class ToolFunction(BaseModel):
    name: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(BaseModel):
    type: Literal["function"]
    function: ToolFunction


class ToolCall(BaseModel):
    """A call an assistant message made (sent back with the tool's result)."""

    model_config = ConfigDict(extra="allow")
    id: str
    type: Literal["function"] = "function"
    function: dict[str, Any]


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = Field(None, max_length=128)
    tool_call_id: str | None = None

    @model_validator(mode="after")
    def _content_or_calls(self) -> ChatMessage:
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError("content: required (null only in an assistant's tool calls)")
        return self

    def for_template(self, image_text: str = "") -> dict[str, Any]:
        """The message as chat templates read it, each image as `image_text` (transformers'
        convention: a call's `arguments` an object, not OpenAI's JSON string)."""
        content = content_text(self.content, image_text)
        message: dict[str, Any] = {"role": self.role, "content": content}
        if self.tool_calls:
            message["tool_calls"] = [call.model_dump() for call in self.tool_calls]
            for call in message["tool_calls"]:
                with contextlib.suppress(TypeError, ValueError):
                    call["function"]["arguments"] = json.loads(call["function"]["arguments"])
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        return message

    @field_validator("content")
    @classmethod
    def _parts(cls, content: str | list[dict[str, Any]] | None) -> str | list[dict] | None:
        return content_parts(content)

    @property
    def images(self) -> list[str]:
        """The URLs of its images (`image_url` parts), in order."""
        return content_images(self.content)


class ChatCompletionRequest(_Sampling):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1, strict=True)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS, strict=True)
    tools: list[Tool] | None = Field(None, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: bool = True

    @model_validator(mode="after")
    def _choice_names_a_tool(self) -> ChatCompletionRequest:
        choice = self.tool_choice
        if choice not in (None, "none") and not self.tools:
            raise ValueError("tool_choice: needs tools")
        if isinstance(choice, dict):
            name = (choice.get("function") or {}).get("name")
            if choice.get("type") != "function" or not isinstance(name, str):
                raise ValueError(
                    "tool_choice: give 'none', 'auto', 'required' or "
                    "{'type': 'function', 'function': {'name': NAME}}"
                )
            if name not in {t.function.name for t in self.tools or ()}:
                raise ValueError(f"tool_choice: no tool named {name[:64]!r} in tools")
        return self

    def forced_tools(self) -> list[dict[str, Any]] | None:
        """The tools one of which the reply must call (`required`, or the named one); None
        when it may answer in text."""
        tools = [t.model_dump(exclude_none=True) for t in self.tools or ()]
        if self.tool_choice == "required":
            return tools
        if isinstance(self.tool_choice, dict):
            name = self.tool_choice["function"]["name"]
            return [t for t in tools if t["function"]["name"] == name]
        return None

    @property
    def token_limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    @model_validator(mode="after")
    def _top_needs_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs: only allowed with logprobs=true")
        return self


class TokenizeRequest(BaseModel):
    """POST /tokenize (vLLM's): a prompt, or chat messages rendered by the chat template."""

    model_config = ConfigDict(extra="allow")
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    tools: list[Tool] | None = Field(None, max_length=128)  # rendered with the messages
    add_special_tokens: bool = True

    @model_validator(mode="before")
    @classmethod
    def _valid_text(cls, data: Any) -> Any:
        if isinstance(data, dict) and (where := _lone_surrogate(data)):
            raise ValueError(f"{where}: not valid Unicode (a lone UTF-16 surrogate)")
        return data

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give either prompt or messages")
        return self


class DetokenizeRequest(BaseModel):
    """POST /detokenize (vLLM's)."""

    model_config = ConfigDict(extra="allow")
    model: str | None = None
    tokens: list[int]


class APIError(AxplugError):
    """A request the server refuses, as an HTTP status and an OpenAI-shaped error."""

    def __init__(self, status: int, message: str, kind: str, param=None, code=None):
        super().__init__(message)
        self.status, self.body = status, error_body(message, kind, param, code)


def invalid(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, "invalid_request_error", param, code)


def check_ids(ids: list[int], vocab: int | None, param: str) -> None:
    """A 400 naming `param` when an id lies outside the vocabulary [0, `vocab`)."""
    if vocab is not None and (bad := [t for t in ids if not 0 <= t < vocab]):
        raise invalid(f"token id {bad[0]} is outside the model's vocabulary [0, {vocab})", param)


def error_body(message: str, kind: str, param: str | None = None, code: str | None = None):
    """An error in the shape OpenAI's API (and its clients) use."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def validation_message(errors: Sequence[Any]) -> tuple[str, str | None]:
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
