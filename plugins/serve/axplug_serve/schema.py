"""What `/openapi.json` says the server returns: the responses' shapes and every error status
a route can give (never FastAPI's default 422: invalid bodies are 400s here)."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel

__all__ = [
    "ChatCompletionResponse",
    "CompletionResponse",
    "DetokenizeResponse",
    "TokenizeResponse",
    "document",
    "responses",
]

_STATUS = {
    400: "invalid request: the message names the field (`param`)",
    401: "missing or wrong API key (servers started with --api-key)",
    403: "not allowed on this server (runtime adapter loading needs --api-key)",
    404: "no such model or route",
    405: "method not allowed (the `Allow` header lists those that are)",
    409: "the adapter name is taken, or no adapter slot is free",
    413: "request body over --max-body-bytes",
    429: "at capacity: retry after `Retry-After` seconds",
    500: "internal server error (logged by the server)",
    503: "the engine is not running",
}


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorDetail


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: str | None
    prompt_logprobs: list[dict[str, dict[str, Any]] | None] | None = None


class CompletionResponse(BaseModel):
    """A whole completion; with `stream`, `text/event-stream` chunks of this shape."""

    id: str
    object: str
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None


class ToolCallOut(BaseModel):
    id: str
    type: str
    function: dict[str, str]  # name, arguments (a JSON string)


class ChatMessageOut(BaseModel):
    role: str
    content: str | None  # None: only tool calls
    tool_calls: list[ToolCallOut] | None = None


class ChatChoice(BaseModel):
    index: int
    message: ChatMessageOut
    logprobs: dict[str, Any] | None
    finish_reason: str | None


class ChatCompletionResponse(BaseModel):
    """A whole chat completion; with `stream`, `chat.completion.chunk` events."""

    id: str
    object: str
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage | None


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str


def responses(*statuses: int, ok: type[BaseModel] | None = None) -> dict[int | str, Any]:
    """FastAPI `responses=`: the 200 body `ok`, and these error statuses, each an
    OpenAI-shaped error."""
    out: dict[int | str, Any] = {status: {"model": ErrorResponse, "description": _STATUS[status]}
                                 for status in statuses}  # fmt: skip
    if ok is not None:
        out[200] = {"model": ok}
    return out


def document(app: FastAPI) -> None:
    """Makes `app.openapi()` list the 200 bodies, the guard's statuses (401, 413, 500) on
    every route and no 422."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema:
            return app.openapi_schema
        schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
        error_ref = {"$ref": "#/components/schemas/ErrorResponse"}
        for operations in schema["paths"].values():
            for method, operation in operations.items():
                responses = operation.setdefault("responses", {})
                responses.pop("422", None)
                guard = [401, 500] + ([413] if method == "post" else [])
                for status in guard:
                    responses.setdefault(str(status), {
                        "description": _STATUS[status],
                        "content": {"application/json": {"schema": error_ref}},
                    })  # fmt: skip
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        for name in ("HTTPValidationError", "ValidationError"):
            components.pop(name, None)
        app.openapi_schema = schema
        return schema

    app.openapi = openapi  # type: ignore[method-assign]  # FastAPI's way to extend the schema
