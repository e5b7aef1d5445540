"""The OpenAI-compatible HTTP API (FastAPI) over an `EngineWorker`."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import secrets
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from axplug.inference import Completion, SamplingParams
from axplug.inference import Request as EngineRequest
from axplug_serve.metrics import CONTENT_TYPE_LATEST, ServerMetrics
from axplug_serve.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    error_body,
    validation_message,
)
from axplug_serve.text import ChatTemplate, TextStream
from axplug_serve.worker import EngineWorker, QueueFullError

__all__ = ["ServerSettings", "create_app"]


@dataclasses.dataclass(frozen=True)
class ServerSettings:
    """What the API needs besides the worker: names, limits and text handling."""

    model_name: str
    tokenizer: Any
    chat_template: ChatTemplate
    stop_tokens: tuple[int, ...] = ()
    default_max_tokens: int = 16  # /v1/completions, as OpenAI's API
    step: int | None = None  # the checkpoint step, shown by /v1/models


class APIError(Exception):
    """A request the server refuses, as an HTTP status and an OpenAI-shaped error."""

    def __init__(self, status: int, message: str, kind: str, param=None, code=None):
        super().__init__(message)
        self.status, self.body = status, error_body(message, kind, param, code)


def create_app(worker: EngineWorker, settings: ServerSettings, metrics: ServerMetrics) -> FastAPI:
    """The app; it starts `worker` on startup and stops it on shutdown."""

    @contextlib.asynccontextmanager
    async def lifespan(_app):
        worker.start()
        try:
            yield
        finally:
            worker.stop()

    app = FastAPI(title="axplug serve", lifespan=lifespan)
    api = _API(worker, settings, metrics)

    @app.exception_handler(APIError)
    async def _api_error(_request, exc: APIError):
        metrics.rejected.labels(str(exc.status)).inc()
        headers = {"Retry-After": "1"} if exc.status == 429 else None
        return JSONResponse(exc.body, status_code=exc.status, headers=headers)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_request, exc: RequestValidationError):
        message, param = validation_message(exc.errors())
        metrics.rejected.labels("400").inc()
        body = error_body(message, "invalid_request_error", param)
        return JSONResponse(body, status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_request, exc: StarletteHTTPException):
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return JSONResponse(error_body(str(exc.detail), kind), status_code=exc.status_code)

    @app.get("/health")
    async def health():
        if worker.healthy:
            return {"status": "ok", "in_flight": worker.in_flight}
        return JSONResponse({"status": "error", "error": str(worker.error)}, status_code=503)

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.exposition(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [api.model_card()]}

    @app.get("/v1/models/{model:path}")
    async def model(model: str):
        api.check_model(model)
        return api.model_card()

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        return await api.completions(body, request)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        return await api.chat_completions(body, request)

    return app


class _Generation:
    """One request in the engine, seen from the event loop: its text as it is generated."""

    def __init__(self, api: _API, endpoint: str, prompt: list[int], sampling, stop: list[str]):
        self.id = uuid.uuid4().hex
        self.prompt, self.endpoint, self._api = prompt, endpoint, api
        self._loop = asyncio.get_running_loop()
        self._queue: asyncio.Queue = asyncio.Queue()
        self._text = TextStream(api.settings.tokenizer, prompt, stop)
        self._arrived = self._last_token = time.perf_counter()
        self.tokens = 0
        self.finish_reason: str | None = None
        api.worker.submit(EngineRequest(prompt, sampling, id=self.id), self._sink)

    def _sink(self, item) -> None:  # the engine thread
        self._loop.call_soon_threadsafe(self._queue.put_nowait, item)

    async def deltas(self) -> AsyncIterator[str]:
        """The text as it becomes final; `finish_reason` is set once it ends."""
        metrics = self._api.metrics
        try:
            while self.finish_reason is None:
                item = await self._queue.get()
                if isinstance(item, ValueError):  # the engine refused the request
                    raise APIError(400, str(item), "invalid_request_error", "prompt") from item
                if isinstance(item, BaseException):  # the engine failed or is stopping
                    raise APIError(500, f"generation failed: {item}", "server_error") from item
                if isinstance(item, Completion):
                    self.finish_reason = "stop" if item.finish_reason == "stop" else "length"
                    if tail := self._text.flush():
                        yield tail
                    break
                if item.token is None:  # a stop token; its Completion follows
                    continue
                now = time.perf_counter()
                latency = (
                    metrics.inter_token_latency if self.tokens else metrics.time_to_first_token
                )
                latency.observe(now - (self._last_token if self.tokens else self._arrived))
                self.tokens, self._last_token = self.tokens + 1, now
                metrics.generation_tokens.inc()
                delta = self._text.push(item.token)
                if self._text.stopped:  # a stop string: the engine need not go on
                    self._api.worker.cancel(self.id)
                    self.finish_reason = "stop"
                if delta:
                    yield delta
        finally:
            reason = self.finish_reason or "cancelled"
            if self.finish_reason is None:  # the client went away, or the request failed
                self._api.worker.cancel(self.id)
            metrics.requests.labels(self.endpoint, reason).inc()
            metrics.request_latency.observe(time.perf_counter() - self._arrived)

    def usage(self) -> dict[str, int]:
        prompt = len(self.prompt)
        return {"prompt_tokens": prompt, "completion_tokens": self.tokens,
                "total_tokens": prompt + self.tokens}  # fmt: skip


class _API:
    def __init__(self, worker: EngineWorker, settings: ServerSettings, metrics: ServerMetrics):
        self.worker, self.settings, self.metrics = worker, settings, metrics
        self.created = int(time.time())

    def model_card(self) -> dict[str, Any]:
        card = {"id": self.settings.model_name, "object": "model", "created": self.created,
                "owned_by": "axplug", "max_model_len": self.worker.engine.max_len}  # fmt: skip
        if self.settings.step is not None:
            card["checkpoint_step"] = self.settings.step
        return card

    def check_model(self, name: str) -> None:
        if name != self.settings.model_name:
            raise APIError(
                404,
                f"The model {name!r} does not exist; this server serves "
                f"{self.settings.model_name!r} (GET /v1/models)",
                "invalid_request_error",
                "model",
                "model_not_found",
            )

    # -- endpoints -------------------------------------------------------------------------

    async def completions(self, body: CompletionRequest, request: Request):
        self.check_model(body.model)
        if isinstance(body.prompt, str):
            prompt = self.settings.tokenizer.encode(body.prompt)
        else:
            prompt = list(body.prompt)
        generation = self._start("completions", body, prompt, body.max_tokens)
        rid, created = f"cmpl-{generation.id}", int(time.time())

        def choice(text: str, finish: str | None) -> dict[str, Any]:
            return {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}

        def chunk(choices: list, usage=None) -> dict[str, Any]:
            return self._chunk(rid, "text_completion", created, choices, usage)

        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)

            async def events():
                async for delta in generation.deltas():
                    yield _sse(chunk([choice(delta, None)]))
                yield _sse(chunk([choice("", generation.finish_reason)]))
                if include_usage:
                    yield _sse(chunk([], generation.usage()))

            return _stream(events())
        text = await _collect(generation, request)
        return chunk([choice(text, generation.finish_reason)], generation.usage())

    async def chat_completions(self, body: ChatCompletionRequest, request: Request):
        self.check_model(body.model)
        messages = [{"role": m.role, "content": m.content} for m in body.messages]
        try:
            text = self.settings.chat_template.render(messages)
        except ValueError as exc:
            raise APIError(400, str(exc), "invalid_request_error", "messages") from None
        prompt = self.settings.tokenizer.encode(text)
        generation = self._start("chat.completions", body, prompt, body.token_limit)
        rid, created = f"chatcmpl-{generation.id}", int(time.time())

        def chunk(choices: list, kind: str, usage=None) -> dict[str, Any]:
            return self._chunk(rid, kind, created, choices, usage)

        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)

            def delta(content: dict, finish: str | None = None) -> dict[str, Any]:
                return {"index": 0, "delta": content, "logprobs": None, "finish_reason": finish}

            async def events():
                kind = "chat.completion.chunk"
                yield _sse(chunk([delta({"role": "assistant", "content": ""})], kind))
                async for text in generation.deltas():
                    yield _sse(chunk([delta({"content": text})], kind))
                yield _sse(chunk([delta({}, generation.finish_reason)], kind))
                if include_usage:
                    yield _sse(chunk([], kind, generation.usage()))

            return _stream(events())
        text = await _collect(generation, request)
        message = {"role": "assistant", "content": text}
        choices = [{"index": 0, "message": message, "logprobs": None,
                    "finish_reason": generation.finish_reason}]  # fmt: skip
        return chunk(choices, "chat.completion", generation.usage())

    def _chunk(self, rid: str, kind: str, created: int, choices: list, usage) -> dict[str, Any]:
        model = self.settings.model_name
        return {"id": rid, "object": kind, "created": created, "model": model,
                "choices": choices, "usage": usage}  # fmt: skip

    def _start(self, endpoint: str, body, prompt: list[int], max_tokens: int | None):
        """Checks the prompt against the engine's limits and submits it."""
        engine = self.worker.engine
        if not prompt:
            raise APIError(400, "the prompt has no tokens", "invalid_request_error", "prompt")
        vocab = engine.vocab_size
        if vocab is not None and (bad := [t for t in prompt if not 0 <= t < vocab]):
            raise APIError(
                400,
                f"token id {bad[0]} is outside the model's vocabulary [0, {vocab})",
                "invalid_request_error",
                "prompt",
            )
        room = engine.max_len + 1 - len(prompt)  # the last new token is never cached
        if max_tokens is None:
            max_tokens = self.settings.default_max_tokens if endpoint == "completions" else room
            max_tokens = min(max_tokens, room)
        if room < 1 or max_tokens > room:
            raise APIError(
                400,
                f"This model's maximum context length is {engine.max_len} tokens; the prompt "
                f"has {len(prompt)} tokens and max_tokens asks for {max_tokens} more "
                f"(prompt + max_tokens - 1 must be <= {engine.max_len}); shorten the prompt "
                "or lower max_tokens",
                "invalid_request_error",
                "max_tokens" if room >= 1 else "prompt",
                "context_length_exceeded",
            )
        sampling = SamplingParams(
            max_new_tokens=max_tokens,
            temperature=body.temperature,
            top_k=max(body.top_k, 0),
            top_p=body.top_p,
            stop_tokens=self.settings.stop_tokens,
            seed=body.seed if body.seed is not None else secrets.randbits(32),
        )
        try:
            generation = _Generation(self, endpoint, prompt, sampling, body.stop)
        except QueueFullError as exc:
            raise APIError(429, str(exc), "rate_limit_error", code="queue_full") from None
        except RuntimeError as exc:  # the engine stopped
            raise APIError(503, str(exc), "server_error") from None
        self.metrics.prompt_tokens.inc(len(prompt))
        return generation


def _sse(data: dict[str, Any]) -> str:
    return f"data: {json.dumps(data)}\n\n"


def _stream(events: AsyncIterator[str]) -> StreamingResponse:
    async def with_done():
        try:
            async for event in events:
                yield event
        except APIError as exc:  # after the headers: the error is the stream's last event
            yield _sse(exc.body)
        yield "data: [DONE]\n\n"

    headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
    return StreamingResponse(with_done(), media_type="text/event-stream", headers=headers)


async def _collect(generation: _Generation, request: Request) -> str:
    """The whole text; the generation is cancelled if the client disconnects first."""

    async def text() -> str:
        return "".join([delta async for delta in generation.deltas()])

    task = asyncio.ensure_future(text())
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
    if not task.done():  # the client left: stop generating for it
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        return ""
    return task.result()


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass
