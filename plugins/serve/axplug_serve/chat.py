"""POST /v1/chat/completions: messages through the chat template (with tools), the reply as
text or as tool calls (the server's `axplug.tool_parsers` format), whole or streamed."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from fastapi import Request

from axplug.api import registry
from axplug.api.config import ConfigError
from axplug_serve.generation import Generation, collect, merged, sse, start_generations
from axplug_serve.generation import stream as event_stream
from axplug_serve.generation import usage as usage_of
from axplug_serve.guided import guide_spec
from axplug_serve.logprobs import chat_logprobs
from axplug_serve.protocol import ChatCompletionRequest, TokenizeRequest, invalid
from axplug_serve.tool_calls import tool_calls

__all__ = ["chat_completions", "prompt_of", "render", "tool_parser"]


def tool_parser(name: str) -> Any:
    """The registered tool-call format `name` (`axplug.tool_parsers`)."""
    return registry.load("tool_parsers", name)()


async def render(api: Any, body: ChatCompletionRequest | TokenizeRequest, image_text="") -> str:
    """The prompt text of `body`'s messages (and tools), each image as `image_text`; a 400
    when the template refuses."""
    messages = [m.for_template(image_text) for m in body.messages or ()]
    tools = [t.model_dump(exclude_none=True) for t in body.tools or ()] or None
    try:
        return await asyncio.to_thread(api.settings.chat_template.render, messages, tools=tools)
    except ValueError as exc:
        raise invalid(str(exc), "messages") from None


async def prompt_of(api: Any, body: ChatCompletionRequest | TokenizeRequest) -> tuple:
    """(the token ids of `body`'s messages, their images' `Request.embeddings` or None): each
    image's marker expanded to its tokens by the model's hook; a 400 for an image refused."""
    urls = [url for message in body.messages or () for url in message.images]
    if not urls:
        return await api.encode(await render(api, body)), None
    images = api.settings.images
    if images is None:
        raise invalid(f"the model {api.settings.model_name!r} takes no images; send text only "
                      "(image_url parts need a vision-language model)", "messages")  # fmt: skip
    try:
        return await images.prompt(await api.encode(await render(api, body, images.marker_text)),
                                   urls)  # fmt: skip
    except ConfigError as exc:
        raise invalid(str(exc), "messages") from None


async def _constraints(api: Any, body: ChatCompletionRequest):
    """The maker of each choice's constraint: the forced tool call's grammar, or the body's
    structured output, or None."""
    forced = body.forced_tools()
    if forced is None:
        return await api.guides.constraints(body)
    if guide_spec(body) is not None:
        raise invalid("tool_choice: a forced tool call and a structured output at once",
                      "tool_choice")  # fmt: skip
    grammar = api.tool_parser.grammar(forced, body.parallel_tool_calls)
    return await asyncio.to_thread(api.guides.compiled, "grammar", grammar, "tool_choice")


class _Reply:
    """One choice's text as it streams: content released while it cannot be a tool call's
    start, the calls parsed at the end."""

    def __init__(self, parser: Any):
        self.parser, self.text, self.sent = parser, "", 0

    def push(self, delta: str) -> str:
        """What of the text so far may go out as content now."""
        self.text += delta
        end = len(self.text) - (self.parser.held(self.text) if self.parser else 0)
        ready = self.text[self.sent : max(end, self.sent)]
        self.sent = max(end, self.sent)
        return ready

    def finish(self) -> tuple[str, list[dict]]:
        """(the content not sent yet, the calls)."""
        content, calls = self.parser.parse(self.text) if self.parser else (self.text, [])
        return content[self.sent :], calls


async def chat_completions(api: Any, body: ChatCompletionRequest, request: Request):
    api.check_model(body.model)
    api.check_fields(body)
    prompt, embeddings = await prompt_of(api, body)
    if body.token_limit == 0:
        raise invalid("max_tokens: must be at least 1 for a chat completion", "max_tokens")
    top_n = (body.top_logprobs or 0) if body.logprobs else None
    parser = api.tool_parser if body.tools and body.tool_choice != "none" else None
    generations = start_generations(api, "chat.completions", body, [prompt], body.token_limit,
                                    body.n, logprobs=top_n, embeddings=[embeddings],
                                    constraints=await _constraints(api, body))  # fmt: skip
    rid, created = f"chatcmpl-{generations[0].id}", int(time.time())

    def chunk(choices: list, kind: str, usage=None) -> dict[str, Any]:
        return api._chunk(rid, kind, created, choices, usage, body.model)

    def logprobs(entries: list) -> dict[str, Any] | None:
        return chat_logprobs(api.texts, entries, top_n) if top_n is not None else None

    def finish_reason(generation: Generation, calls: list) -> str | None:
        return "tool_calls" if calls else generation.finish_reason

    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        kind = "chat.completion.chunk"

        def delta(index: int, content: dict, entries=(), finish: str | None = None):
            return {"index": index, "delta": content,
                    "logprobs": logprobs(list(entries)) if entries else None,
                    "finish_reason": finish}  # fmt: skip

        async def events(index: int, generation: Generation):
            yield sse(chunk([delta(index, {"role": "assistant", "content": ""})], kind))
            reply, pending = _Reply(parser), []
            async for text, entries in generation.deltas():
                pending += entries
                if ready := reply.push(text):
                    yield sse(chunk([delta(index, {"content": ready}, pending)], kind))
                    pending = []
            rest, calls = reply.finish()
            if rest or pending:
                yield sse(chunk([delta(index, {"content": rest}, pending)], kind))
            if calls:
                yield sse(chunk([delta(index, {"tool_calls": tool_calls(calls, index=True)})],
                                kind))  # fmt: skip
            yield sse(chunk([delta(index, {}, (), finish_reason(generation, calls))], kind))

        async def usage_event():
            yield sse(chunk([], kind, usage_of([prompt], generations)))

        return event_stream(merged(generations, events), usage_event() if include_usage else None)
    choices = []
    for i, (text, entries) in enumerate(await collect(generations, request)):
        content, calls = parser.parse(text) if parser else (text, [])
        # With calls, content is the text before them, None when there is none.
        message: dict[str, Any] = {
            "role": "assistant",
            "content": (content or None) if calls else text,
        }
        if calls:
            message["tool_calls"] = tool_calls(calls)
        choices.append({"index": i, "message": message, "logprobs": logprobs(entries),
                        "finish_reason": finish_reason(generations[i], calls)})  # fmt: skip
    return chunk(choices, "chat.completion", usage_of([prompt], generations))
