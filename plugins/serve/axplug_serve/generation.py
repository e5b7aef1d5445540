"""One request's generation seen from the event loop, and the streaming and collecting of
several at once (a request's prompts and `n` choices)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import secrets
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import Request
from fastapi.responses import StreamingResponse

from axplug.api.run import Completion, Logprob
from axplug.api.run import Request as EngineRequest
from axplug_serve.protocol import APIError, check_ids, invalid
from axplug_serve.text import TextStream
from axplug_serve.worker import QueueFullError

__all__ = ["Generation", "collect", "merged", "sse", "start_generations", "stream", "usage"]


class Generation:
    """One request in the engine, seen from the event loop: its text (and the logprobs of the
    tokens behind it) as it is generated."""

    def __init__(self, api: Any, endpoint: str, prompt: list[int], sampling, stop: list[str],
                 constraint: Any = None, adapter: int = 0, embeddings: Any = None):  # fmt: skip
        self.id, self.constraint, self.adapter = uuid.uuid4().hex, constraint, adapter
        self.embeddings = embeddings  # the images' features (`Request.embeddings`), or None
        self.prompt, self.endpoint, self._api = prompt, endpoint, api
        self.sampling = sampling
        self._loop = asyncio.get_running_loop()
        self._queue: asyncio.Queue = asyncio.Queue()
        self._text = TextStream(api.settings.tokenizer, prompt, stop)
        self._arrived = self._last_token = time.perf_counter()
        self.tokens = 0
        self.finish_reason: str | None = None
        self.prompt_logprobs: list[Logprob | None] | None = None

    def submission(self) -> tuple[EngineRequest, Callable]:
        request = EngineRequest(self.prompt, self.sampling, id=self.id, constraint=self.constraint,
                                adapter=self.adapter, embeddings=self.embeddings)  # fmt: skip
        return request, self._sink

    def _sink(self, item) -> None:  # the engine thread
        self._loop.call_soon_threadsafe(self._queue.put_nowait, item)

    async def deltas(self) -> AsyncIterator[tuple[str, list[Logprob]]]:
        """The text as it becomes final, with the logprobs of the tokens it came from (when
        asked for); `finish_reason` is set once it ends."""
        metrics = self._api.metrics
        pending: list[Logprob] = []
        try:
            while self.finish_reason is None:
                item = await self._queue.get()
                if isinstance(item, ValueError):  # the engine refused the request
                    raise invalid(str(item), "prompt") from item
                if isinstance(item, BaseException):  # the engine failed or is stopping
                    raise APIError(500, f"generation failed: {item}", "server_error") from item
                if isinstance(item, Completion):
                    self.prompt_logprobs = item.prompt_logprobs
                    self.finish_reason = "stop" if item.finish_reason == "stop" else "length"
                    tail = self._text.flush()
                    if tail or pending:
                        yield tail, pending
                    break
                if item.token is None:  # a stop token (or nothing to generate); Completion follows
                    continue
                now = time.perf_counter()
                latency = (
                    metrics.inter_token_latency if self.tokens else metrics.time_to_first_token
                )
                latency.observe(now - (self._last_token if self.tokens else self._arrived))
                self.tokens, self._last_token = self.tokens + 1, now
                metrics.generation_tokens.inc()
                if item.logprob is not None:
                    pending.append(item.logprob)
                delta = self._text.push(item.token)
                if self._text.stopped:  # a stop string: the engine need not go on
                    self._api.worker.cancel(self.id)
                    self.finish_reason = "stop"
                if delta or (self._text.stopped and pending):
                    yield delta, pending
                    pending = []
        finally:
            reason = self.finish_reason or "cancelled"
            if self.finish_reason is None:  # the client went away, or the request failed
                self._api.worker.cancel(self.id)
            metrics.requests.labels(self.endpoint, reason).inc()
            metrics.request_latency.observe(time.perf_counter() - self._arrived)

    async def collect(self) -> tuple[str, list[Logprob]]:
        """The whole text and its tokens' logprobs."""
        text, logprobs = [], []
        async for delta, entries in self.deltas():
            text.append(delta)
            logprobs.extend(entries)
        return "".join(text), logprobs


def sse(data: dict[str, Any]) -> str:
    return f"data: {json.dumps(data)}\n\n"


async def merged(generations: list[Generation], events) -> AsyncIterator[str]:
    """`events(index, generation)` of every generation, interleaved as they come."""
    if len(generations) == 1:
        async for event in events(0, generations[0]):
            yield event
        return
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(index: int, generation: Generation) -> None:
        try:
            async for event in events(index, generation):
                await queue.put(event)
        except APIError as exc:
            await queue.put(exc)
        finally:
            await queue.put(done)

    tasks = [asyncio.ensure_future(pump(i, g)) for i, g in enumerate(generations)]
    try:
        remaining = len(tasks)
        while remaining:
            item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, APIError):
                raise item
            else:
                yield item
    finally:
        for task in tasks:  # a client gone, or a failure: the others stop too
            task.cancel()


def stream(events: AsyncIterator[str], tail: AsyncIterator[str] | None) -> StreamingResponse:
    async def with_done():
        try:
            async for event in events:
                yield event
            if tail is not None:
                async for event in tail:
                    yield event
        except APIError as exc:  # after the headers: the error is the stream's last event
            yield sse(exc.body)
        yield "data: [DONE]\n\n"

    headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
    return StreamingResponse(with_done(), media_type="text/event-stream", headers=headers)


async def collect(generations: list[Generation], request: Request) -> list[tuple[str, list]]:
    """Every generation's text and logprobs; all are cancelled if the client disconnects or
    one fails (its error is raised)."""
    tasks = [asyncio.ensure_future(g.collect()) for g in generations]
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        pending: set[asyncio.Future[Any]] = set(tasks)
        while pending:
            finished, pending = await asyncio.wait(
                pending | {gone}, return_when=asyncio.FIRST_COMPLETED
            )
            pending.discard(gone)
            if gone in finished or any(t.exception() for t in finished if t is not gone):
                break
    finally:
        gone.cancel()
        for task in tasks:
            if not task.done():
                task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
    return [task.result() if not task.cancelled() else ("", []) for task in tasks]


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def usage(prompts: list[list[int]], generations: list[Generation]) -> dict[str, int]:
    """OpenAI's `usage` of a request's prompts and generations."""
    prompt = sum(map(len, prompts))
    completion = sum(g.tokens for g in generations)
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion}  # fmt: skip


def start_generations(
    api: Any,
    endpoint: str,
    body: Any,
    prompts: list[list[int]],
    max_tokens: int | None,
    n: int,
    *,
    logprobs: int | None = None,
    prompt_logprobs: int | None = None,
    constraints: Callable | None = None,
    embeddings: Any = None,
) -> list[Generation]:
    """Checks each prompt against the engine's limits and submits `n` generations of each,
    all or none; choice i is prompt i // n. `constraints` makes each one's constraint;
    `embeddings` are each prompt's images' features (`Request.embeddings`, or None)."""
    engine, settings = api.worker.engine, api.settings
    stop_tokens = () if body.ignore_eos else settings.stop_tokens
    stop_tokens = tuple(dict.fromkeys([*stop_tokens, *body.stop_token_ids]))
    seed = body.seed if body.seed is not None else secrets.randbits(32)
    check_ids([int(t) for t in body.logit_bias or {}], api.vocab_size, "logit_bias")
    generations = []
    for prompt, features in zip(prompts, embeddings or [None] * len(prompts), strict=True):
        if not prompt:
            raise invalid("the prompt has no tokens", "prompt")
        check_ids(prompt, api.vocab_size, "prompt")
        room = engine.max_len + 1 - len(prompt)  # the last new token is never cached
        wanted = max_tokens
        if wanted is None:
            wanted = settings.default_max_tokens if endpoint == "completions" else room
            wanted = min(wanted, room)
        if room < 1 or wanted > room:
            raise invalid(
                f"This model's maximum context length is {engine.max_len} tokens; the prompt "
                f"has {len(prompt)} tokens and max_tokens asks for {wanted} more (prompt + "
                f"max_tokens - 1 must be <= {engine.max_len}); shorten the prompt or lower "
                "max_tokens",
                "max_tokens" if room >= 1 else "prompt",
                "context_length_exceeded",
            )
        for j in range(n):  # each of n choices its own sample
            sampling = body.sampling_params(wanted, stop_tokens, (seed + j) % 2**32, logprobs,
                                            prompt_logprobs)  # fmt: skip
            constraint = constraints() if constraints is not None else None
            generations.append(Generation(api, endpoint, prompt, sampling, body.stop, constraint,
                                          embeddings=features))  # fmt: skip
    capacity = api.worker.capacity
    if len(generations) > capacity:
        raise invalid(
            f"this request asks for {len(generations)} generations ({len(prompts)} prompt(s) "
            f"x n={n}); this server runs at most {capacity} at once (--num-slots + "
            "--max-queue): split it",
            "n" if n > 1 else "prompt",
        )
    # Resolved right before submitting: an adapter unloaded since the request arrived is a 404,
    # and its slot is not reused while a request submitted here holds it.
    for generation in generations:
        generation.adapter = api.adapter_of(body.model)
    try:
        api.worker.submit_all([g.submission() for g in generations])
    except QueueFullError as exc:
        raise APIError(429, str(exc), "rate_limit_error", code="queue_full") from None
    except RuntimeError as exc:  # the engine stopped
        raise APIError(503, str(exc), "server_error") from None
    api.metrics.prompt_tokens.inc(sum(map(len, prompts)))
    return generations
