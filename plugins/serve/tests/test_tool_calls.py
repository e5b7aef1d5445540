"""Tool-call formats: the Hermes and LLaMA 3 JSON parsers on replies with content, several
calls and malformed calls, and streamed content released exactly up to where a call starts."""

import json

import pytest
from axplug_serve.tool_calls import HermesToolParser, Llama3JsonToolParser, call_schema

from axplug.api import registry

HERMES = (
    'I will look.\n<tool_call>\n{"name": "weather", "arguments": {"city": "Elsinore"}}\n'
    '</tool_call>\n<tool_call>{"name": "time", "arguments": {}}</tool_call>'
)
LLAMA3 = (
    '{"name": "weather", "parameters": {"city": "Elsinore"}}; {"name": "time", "parameters": {}}'
)


@pytest.mark.parametrize(
    "parser, text",
    [(HermesToolParser(), HERMES), (Llama3JsonToolParser(), LLAMA3)],
    ids=["hermes", "llama3_json"],
)
def test_parsers_split_content_and_calls(parser, text):
    content, calls = parser.parse(text)
    assert content == ("I will look." if parser.name == "hermes" else "")
    assert [c["name"] for c in calls] == ["weather", "time"]
    assert [json.loads(c["arguments"]) for c in calls] == [{"city": "Elsinore"}, {}]
    # Malformed calls, and plain text, stay content.
    broken = text.replace('"city"', "city")
    assert parser.parse(broken) == (broken, [])
    assert parser.parse("Just words.") == ("Just words.", [])


@pytest.mark.parametrize("parser", [HermesToolParser(), Llama3JsonToolParser()], ids=str)
@pytest.mark.parametrize("text", [HERMES, LLAMA3, "No calls at all <tool", "  plain"])
def test_streamed_content_is_released_up_to_the_first_call(parser, text):
    """Fed one character at a time, what `held` lets out before the end is a prefix of the
    content `parse` finds, and never part of a call."""
    content, calls = parser.parse(text)
    for end in range(len(text) + 1):
        sent = text[: end - parser.held(text[:end])]
        assert content.startswith(sent) or not calls and text.startswith(sent), (end, sent)


def test_the_call_schema_names_each_tool_and_its_parameters():
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}},
             {"type": "function", "function": {"name": "g"}}]  # fmt: skip
    schema = call_schema(tools, "parameters")
    assert [c["properties"]["name"] for c in schema["anyOf"]] == [{"const": "f"}, {"const": "g"}]
    assert all(c["required"] == ["name", "parameters"] for c in schema["anyOf"])


def test_both_formats_are_registered():
    assert {"hermes", "llama3_json"} <= set(registry.names("tool_parsers"))
