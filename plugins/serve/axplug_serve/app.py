"""The OpenAI-compatible HTTP API (FastAPI) over an `EngineWorker`."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import Iterable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from axplug_serve import chat
from axplug_serve.adapters import add_adapter_routes
from axplug_serve.generation import (
    Generation,
    collect,
    merged,
    sse,
    start_generations,
    stream,
    usage,
)
from axplug_serve.guard import Guard
from axplug_serve.guided import Guides
from axplug_serve.logprobs import TokenTexts, completion_logprobs, prompt_logprobs
from axplug_serve.metrics import CONTENT_TYPE_LATEST, ServerMetrics
from axplug_serve.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    check_ids,
    error_body,
    invalid,
    validation_message,
)
from axplug_serve.schema import (
    ChatCompletionResponse,
    CompletionResponse,
    DetokenizeResponse,
    TokenizeResponse,
    document,
    responses,
)
from axplug_serve.text import ChatTemplate
from axplug_serve.worker import EngineWorker

__all__ = ["ServerSettings", "create_app", "TEMPLATE_HEADER"]

TEMPLATE_HEADER = "x-axplug-chat-template"  # on chat completions: the template's origin

log = logging.getLogger("axplug.serve")


@dataclasses.dataclass(frozen=True)
class ServerSettings:
    """What the API needs besides the worker: names, limits, access and text handling."""

    model_name: str
    tokenizer: Any
    chat_template: ChatTemplate
    stop_tokens: tuple[int, ...] = ()
    default_max_tokens: int = 16  # /v1/completions, as OpenAI's API
    step: int | None = None  # the checkpoint step, shown by /v1/models
    api_keys: tuple[str, ...] = ()  # none: no key needed
    open_paths: tuple[str, ...] = ("/health", "/metrics")  # reachable without a key
    max_body_bytes: int = 8 << 20
    strict_fields: bool = False  # refuse unknown request fields instead of ignoring them
    allowed_origins: tuple[str, ...] = ()  # CORS: none allowed
    tool_parser: str = "hermes"  # the format of tool calls in chat replies (axplug.tool_parsers)
    images: Any = None  # a vision-language model's `axplug_serve.images.ImagePrompts`


def create_app(
    worker: EngineWorker, settings: ServerSettings, metrics: ServerMetrics, adapters: Any = None
) -> FastAPI:
    """The app; it starts `worker` on startup and stops it on shutdown. `adapters`
    (`axplug_serve.adapters.Adapters`): LoRA adapters served by name over the model."""

    @contextlib.asynccontextmanager
    async def lifespan(_app):
        worker.start()
        try:
            yield
        finally:
            worker.stop()

    app = FastAPI(title="axplug serve", lifespan=lifespan)
    api = _API(worker, settings, metrics, adapters)

    def rejected(status: int) -> None:
        metrics.rejected.labels(str(status)).inc()

    app.add_middleware(
        Guard,
        api_keys=settings.api_keys,
        open_paths=settings.open_paths,
        max_body_bytes=settings.max_body_bytes,
        on_reject=rejected,
    )
    if settings.allowed_origins:  # outside the guard: preflights need no key
        app.add_middleware(CORSMiddleware, allow_origins=list(settings.allowed_origins),
                           allow_methods=["GET", "POST"], allow_headers=["*"])  # fmt: skip

    @app.exception_handler(APIError)
    async def _api_error(_request, exc: APIError):
        rejected(exc.status)
        headers = {"Retry-After": "1"} if exc.status == 429 else None
        return JSONResponse(exc.body, status_code=exc.status, headers=headers)

    @app.exception_handler(RequestValidationError)
    async def _invalid_body(_request, exc: RequestValidationError):
        message, param = validation_message(exc.errors())
        rejected(400)
        return JSONResponse(error_body(message, "invalid_request_error", param), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_request, exc: StarletteHTTPException):
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return JSONResponse(
            error_body(str(exc.detail), kind), status_code=exc.status_code, headers=exc.headers
        )  # fmt: skip (405 keeps its Allow header)

    @app.get("/health", responses=responses(503))
    async def health():
        if worker.healthy:
            return {"status": "ok", "in_flight": worker.in_flight}
        return JSONResponse({"status": "error", "error": str(worker.error)}, status_code=503)

    @app.get("/metrics", response_class=Response)
    async def prometheus():
        return Response(metrics.exposition(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": api.model_cards()}

    @app.get("/v1/models/{model:path}", responses=responses(404))
    async def model(model: str):
        api.check_model(model)
        return next(card for card in api.model_cards() if card["id"] == model)

    @app.post("/v1/completions", responses=responses(400, 404, 429, 503, ok=CompletionResponse))
    async def completions(body: CompletionRequest, request: Request):
        return await api.completions(body, request)

    @app.post(
        "/v1/chat/completions", responses=responses(400, 404, 429, 503, ok=ChatCompletionResponse)
    )
    async def chat_completions(body: ChatCompletionRequest, request: Request, response: Response):
        result = await api.chat_completions(body, request)
        # Which template rendered the messages: the run's, a --chat-template file, or ChatML.
        target = result if isinstance(result, Response) else response
        target.headers[TEMPLATE_HEADER] = settings.chat_template.origin
        return result

    @app.post("/tokenize", responses=responses(400, 404, ok=TokenizeResponse))
    async def tokenize(body: TokenizeRequest):
        return await api.tokenize(body)

    @app.post("/detokenize", responses=responses(400, 404, ok=DetokenizeResponse))
    async def detokenize(body: DetokenizeRequest):
        return await api.detokenize(body)

    @app.get("/tokenizer_info")
    async def tokenizer_info():
        return api.tokenizer_info()

    if adapters is not None:
        add_adapter_routes(app, api)
    document(app)
    return app


class _API:
    def __init__(self, worker: EngineWorker, settings: ServerSettings, metrics: ServerMetrics,
                 adapters: Any = None):  # fmt: skip
        self.worker, self.settings, self.metrics = worker, settings, metrics
        self.adapters = adapters
        self.created = int(time.time())
        self.texts = TokenTexts(settings.tokenizer)
        self.guides = Guides(settings.tokenizer, worker.engine.vocab_size)
        self.tool_parser = chat.tool_parser(settings.tool_parser)
        self._unknown_fields_seen: set[str] = set()

    def model_cards(self) -> list[dict[str, Any]]:
        """The model, then each LoRA adapter over it (`parent`: the model, `root`: its run)."""
        base = self.settings.model_name
        card = {"id": base, "object": "model", "created": self.created,
                "owned_by": "axplug", "max_model_len": self.worker.engine.max_len,
                "chat_template": self.settings.chat_template.origin}  # fmt: skip
        if self.settings.step is not None:
            card["checkpoint_step"] = self.settings.step
        loras = self.adapters.cards() if self.adapters is not None else []
        return [card, *({**card, "id": name, "root": run, "parent": base} for name, run in loras)]

    def adapter_of(self, name: str | None) -> int:
        """The adapter slot requests for model `name` decode with (0: the model itself)."""
        self.check_model(name)
        return (self.adapters.slot(name) or 0) if self.adapters is not None else 0

    @property
    def vocab_size(self) -> int | None:
        return self.worker.engine.vocab_size or self.settings.tokenizer.vocab_size

    def check_model(self, name: str | None) -> None:
        known = name is None or name == self.settings.model_name
        if not known and (self.adapters is None or self.adapters.slot(name) is None):
            served = ", ".join(repr(card["id"]) for card in self.model_cards())
            raise APIError(
                404,
                f"The model {name!r} does not exist; this server serves {served} (GET /v1/models)",
                "invalid_request_error",
                "model",
                "model_not_found",
            )

    def check_fields(self, body) -> None:
        """Unknown fields: logged once each, or refused with `strict_fields`."""
        unknown = sorted(body.model_extra or ())
        if unknown and self.settings.strict_fields:
            raise invalid(f"{unknown[0]}: unknown field (the server runs with --strict-fields)",
                           unknown[0])  # fmt: skip
        for name in unknown:
            if name not in self._unknown_fields_seen:
                self._unknown_fields_seen.add(name)
                log.warning("ignoring the unknown request field %r (logged once)", name[:64])

    async def encode(self, text: str) -> list[int]:
        """Token ids of `text`, off the event loop: a long prompt never stalls other requests."""
        return await asyncio.to_thread(self.settings.tokenizer.encode, text)

    # -- endpoints -------------------------------------------------------------------------

    async def completions(self, body: CompletionRequest, request: Request):
        self.check_model(body.model)
        self.check_fields(body)
        prompts = [await self.encode(p) if isinstance(p, str) else list(p) for p in body.prompts]
        if body.max_tokens == 0 and not body.echo:
            raise invalid("max_tokens: 0 needs echo=true (to score the prompt)", "max_tokens")
        if body.stream and body.echo and body.logprobs is not None:
            raise invalid("echo with logprobs is not streamed; set stream=false", "stream")
        prompt_top = [n for n in (body.logprobs if body.echo else None, body.prompt_logprobs)
                      if n is not None]  # fmt: skip
        scoring = {
            "logprobs": body.logprobs if body.max_tokens != 0 else None,
            "prompt_logprobs": max(prompt_top) if prompt_top else None,
        }
        if body.max_tokens == 0 and scoring["prompt_logprobs"] is None:
            scoring["prompt_logprobs"] = 0  # only echo: the engine still sees the prompt
        constraints = await self.guides.constraints(body)
        generations = start_generations(self, "completions", body, prompts, body.max_tokens,
                                        body.n, **scoring, constraints=constraints)  # fmt: skip
        rid, created = f"cmpl-{generations[0].id}", int(time.time())
        echoed = [
            self._echo(p, ids) if body.echo else ""
            for p, ids in zip(body.prompts, prompts, strict=True)
        ]

        def choice(index: int, text: str, entries: list, finish: str | None, *,
                   with_prompt: bool = False, start: int = 0):  # fmt: skip
            """Choice `index`: `text` from the tokens of `entries` (after the prompt's when
            `with_prompt`), whose text starts at character `start` of the choice's."""
            generation = generations[index]
            out = {"index": index, "text": text, "logprobs": None, "finish_reason": finish}
            if body.logprobs is not None and (entries or with_prompt):
                ids, scored = [e.token for e in entries], list(entries)
                if with_prompt:
                    ids = [*generation.prompt, *ids]
                    scored = [*(generation.prompt_logprobs or []), *scored]
                out["logprobs"] = completion_logprobs(self.texts, ids, scored, body.logprobs,
                                                      start)  # fmt: skip
            if body.prompt_logprobs is not None and finish is not None:
                out["prompt_logprobs"] = prompt_logprobs(
                    self.texts, generation.prompt_logprobs or [], body.prompt_logprobs
                )
            return out

        def chunk(choices: list, usage=None) -> dict[str, Any]:
            return self._chunk(rid, "text_completion", created, choices, usage, body.model)

        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)

            async def events(index: int, generation: Generation):
                echo = echoed[index // body.n]
                if echo:
                    yield sse(chunk([choice(index, echo, [], None)]))
                # Offsets count each token's own text, as the whole response's do (a token
                # that ends inside a character reads U+FFFD: one character more than the text).
                offset = self._token_chars(generation.prompt) if echo else 0
                async for delta, entries in generation.deltas():
                    yield sse(chunk([choice(index, delta, entries, None, start=offset)]))
                    offset += self._token_chars(e.token for e in entries)
                yield sse(chunk([choice(index, "", [], generation.finish_reason)]))

            async def usage_event():
                yield sse(chunk([], usage(prompts, generations)))

            return stream(merged(generations, events), usage_event() if include_usage else None)
        results = await collect(generations, request)
        choices = [
            choice(
                i,
                echoed[i // body.n] + text,
                entries,
                generations[i].finish_reason,
                with_prompt=body.echo,
            )  # fmt: skip
            for i, (text, entries) in enumerate(results)
        ]
        return chunk(choices, usage(prompts, generations))

    chat_completions = chat.chat_completions

    async def tokenize(self, body: TokenizeRequest) -> dict[str, Any]:
        self.check_model(body.model)
        if body.messages is not None:  # as a chat completion's: images expanded
            tokens, _ = await chat.prompt_of(self, body)
        else:
            tokens = await self.encode(body.prompt or "")
        bos = self.settings.tokenizer.bos_id
        if body.add_special_tokens and bos is not None and tokens[:1] != [bos]:
            tokens = [bos, *tokens]
        return {"count": len(tokens), "max_model_len": self.worker.engine.max_len,
                "tokens": tokens}  # fmt: skip

    async def detokenize(self, body: DetokenizeRequest) -> dict[str, str]:
        self.check_model(body.model)
        check_ids(body.tokens, self.vocab_size, "tokens")
        return {"prompt": await asyncio.to_thread(self.settings.tokenizer.decode, body.tokens)}

    def tokenizer_info(self) -> dict[str, Any]:
        tokenizer = self.settings.tokenizer

        def text(token_id: int | None) -> str | None:
            return tokenizer.decode([token_id]) if token_id is not None else None

        return {
            "tokenizer_class": type(tokenizer).__name__,
            "vocab_size": tokenizer.vocab_size,
            "model_max_length": self.worker.engine.max_len,
            "bos_token": text(tokenizer.bos_id),
            "eos_token": text(tokenizer.eos_id),
            "pad_token": text(tokenizer.pad_id),
            "chat_template": self.settings.chat_template.source,
        }

    # -- helpers -----------------------------------------------------------------------------

    def _chunk(self, rid: str, kind: str, created: int, choices: list, usage,
               model: str | None) -> dict[str, Any]:  # fmt: skip
        model = model or self.settings.model_name
        return {"id": rid, "object": kind, "created": created, "model": model,
                "choices": choices, "usage": usage}  # fmt: skip

    def _echo(self, prompt: str | list[int], ids: list[int]) -> str:
        return prompt if isinstance(prompt, str) else self.settings.tokenizer.decode(ids)

    def _token_chars(self, ids: Iterable[int]) -> int:
        """The characters of `ids`' texts token by token: where logprobs' `text_offset` goes."""
        return sum(len(self.texts.text(token)) for token in ids)
