"""Tool calls in chat completions: the formats models write them in (`axplug.tool_parsers`
entries), each a parser of the generated text and a grammar that forces a call (for
`tool_choice: required` or a named function, through the structured-output guide)."""

from __future__ import annotations

import json
import re
import secrets
from typing import Any

__all__ = ["HermesToolParser", "Llama3JsonToolParser", "ToolParser", "call_schema", "tool_calls"]

# Compact JSON with OpenAI's separators inside the forced calls (llguidance's JSON options).
_COMPACT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def call_schema(tools: list[dict], arguments_key: str = "arguments") -> dict:
    """A JSON schema of one call of any function in `tools` (OpenAI's tool dicts): its name
    and its arguments under `arguments_key`, valid under the function's parameters."""
    choices = [
        {
            "type": "object",
            "properties": {
                "name": {"const": t["function"]["name"]},
                arguments_key: t["function"].get("parameters") or {"type": "object"},
            },
            "required": ["name", arguments_key],
            "additionalProperties": False,
        }
        for t in tools
    ]
    return {"anyOf": choices, "x-guidance": _COMPACT}


class ToolParser:
    """A tool-call format (an `axplug.tool_parsers` entry): `parse` splits generated text into
    content and calls, `grammar` is a Lark grammar (llguidance's, `%json` for a schema) whose
    every sentence is one call (several with `parallel`) of one of `tools`."""

    name = ""
    marker = ""  # the text a call starts with, held back from streamed content

    def held(self, text: str) -> int:
        """How many characters at the end of `text` (a reply so far) may belong to a call:
        from the marker on, or a partial marker at the end, and whitespace before them."""
        at = text.find(self.marker) if self.marker else -1
        if at < 0:
            at = len(text)
            for k in range(min(len(self.marker) - 1, len(text)), 0, -1):
                if text.endswith(self.marker[:k]):
                    at = len(text) - k
                    break
        return len(text) - len(text[:at].rstrip())

    def parse(self, text: str) -> tuple[str, list[dict[str, str]]]:
        """(content, calls): the text that is not calls, and each call's `name` and
        `arguments` (a JSON string); text that only looks like a call stays content."""
        raise NotImplementedError

    def grammar(self, tools: list[dict], parallel: bool) -> str:
        raise NotImplementedError


class HermesToolParser(ToolParser):
    """Hermes and Qwen's format: `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`,
    one block per call, after any content."""

    name = "hermes"
    marker = "<tool_call>"
    _block = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)

    def parse(self, text: str) -> tuple[str, list[dict[str, str]]]:
        calls = []
        for body in self._block.findall(text):
            call = _loaded_call(body, "arguments")
            if call is None:
                return text, []
            calls.append(call)
        if not calls:
            return text, []
        return text[: text.index(self.marker)].rstrip(), calls

    def grammar(self, tools: list[dict], parallel: bool) -> str:
        schema = json.dumps(call_schema(tools))
        repeat = ' ("\\n" call)*' if parallel else ""
        return f'start: call{repeat}\ncall: "<tool_call>\\n" %json {schema} "\\n</tool_call>"\n'


class Llama3JsonToolParser(ToolParser):
    """LLaMA 3.1's JSON tool calls: the reply is `{"name": ..., "parameters": {...}}`
    (several joined by `; `)."""

    name = "llama3_json"

    def held(self, text: str) -> int:
        stripped = text.lstrip()
        return len(text) if not stripped or stripped.startswith("{") else 0

    def parse(self, text: str) -> tuple[str, list[dict[str, str]]]:
        decoder, at, calls = json.JSONDecoder(), len(text) - len(text.lstrip()), []
        while at < len(text):
            try:
                body, at = decoder.raw_decode(text, at)
            except ValueError:
                return text, []
            if (call := _loaded_call(body, "parameters")) is None:
                return text, []
            calls.append(call)
            at += len(text[at:]) - len(text[at:].lstrip().removeprefix(";").lstrip())
        return ("", calls) if calls else (text, [])

    def grammar(self, tools: list[dict], parallel: bool) -> str:
        schema = json.dumps(call_schema(tools, "parameters"))
        repeat = ' ("; " call)*' if parallel else ""
        return f"start: call{repeat}\ncall: %json {schema}\n"


def _loaded_call(body: Any, arguments_key: str) -> dict[str, str] | None:
    """A call from `body` (its JSON text, or the object), else None."""
    try:
        call = json.loads(body) if isinstance(body, str) else body
    except ValueError:
        return None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return None
    arguments = call.get(arguments_key, call.get("arguments", {}))
    return {"name": call["name"], "arguments": json.dumps(arguments)}


def tool_calls(calls: list[dict[str, str]], *, index: bool = False) -> list[dict[str, Any]]:
    """`calls` in OpenAI's shape (`id`, `type`, `function`; a streamed delta's with `index`)."""
    shaped = []
    for i, call in enumerate(calls):
        item = {"id": f"call_{secrets.token_hex(12)}", "type": "function", "function": call}
        shaped.append({"index": i, **item} if index else item)
    return shaped
