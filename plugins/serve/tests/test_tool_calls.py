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


@pytest.mark.parametrize(
    "parser", [HermesToolParser(), Llama3JsonToolParser()], ids=["hermes", "llama3_json"]
)
@pytest.mark.parametrize(
    "text",
    [HERMES, LLAMA3, "No calls at all <tool", "  plain"],
    ids=["hermes-calls", "llama3-calls", "partial-marker", "plain"],
)
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


def test_auto_returns_the_call_a_fine_tuned_model_makes(tmp_path, axplug_cli):
    """A tiny model trained on one conversation whose reply is a tool call: asked the same
    with tools and `tool_choice: auto`, the server returns that call, whole and streamed."""
    import openai
    from axplug_serve.testing import serve_in_thread
    from axplug_serve.text import DEFAULT_CHAT_TEMPLATE, ChatTemplate
    from axplug_testing import tiny_train_args

    from axplug.api.data import prepare_data

    tools = [{"type": "function", "function": {"name": "rain"}}]
    messages = [{"role": "user", "content": "Rain in Rome?"}]
    call = {"name": "rain", "arguments": {"city": "Rome"}}
    reply = f"<tool_call>\n{json.dumps(call)}\n</tool_call>"
    text = ChatTemplate(DEFAULT_CHAT_TEMPLATE).render(
        [*messages, {"role": "assistant", "content": reply}], add_generation_prompt=False,
        tools=tools,
    )  # fmt: skip
    (tmp_path / "chat.jsonl").write_text((json.dumps({"text": text}) + "\n") * 32)
    prepare_data([tmp_path / "chat.jsonl"], tokenizer="bytes", output=tmp_path / "data",
                 workers=1)  # fmt: skip
    run = tmp_path / "run"
    # RoPE (llama-tiny) and a row per conversation, at position 0 as when served: 30 steps
    # memorize it (gpt-tiny, without positions, took 200 of packed rows); 50 for margin (the
    # smallest gap of the greedy reply's two best logprobs was 6 nats).
    args = tiny_train_args(run, preset="llama-tiny", max_steps=50)
    args += ["--input", f"token_file:path={str(tmp_path / 'data')!r},rows='documents'", "--set",
             f"input.seq_len={len(text)}", "--set", "input.batch_size=1", "--set",
             "learner.learning_rate=1e-2", "--set", "learner.warmup_steps=0", "--set",
             "learner.schedule='constant'", "-q"]  # fmt: skip
    assert axplug_cli(*args).exit_code == 0
    # The engine shapes of test_serve.py's server (over a model of the same shapes): its
    # programs, from the session's compilation cache.
    options = ["--checkpoint", str(run), "--num-slots", "2", "--max-len", "256",
               "--prefill-chunk", "16", "--no-warmup"]  # fmt: skip
    with serve_in_thread(options, tmp_path / "server.log") as base:
        client = openai.OpenAI(base_url=base + "/v1", api_key="-", max_retries=0)
        # The bytes tokenizer has no EOS: nothing taught the model to stop, so the reply ends
        # where the conversation it learned does (" " + reply + "\n\n").
        asked = dict(model="run", messages=messages, tools=tools, temperature=0,
                     max_tokens=len(reply) + 3)  # fmt: skip
        out = client.chat.completions.create(**asked)
        assert out.choices[0].message.tool_calls, out.choices[0].message.content
        (got,) = out.choices[0].message.tool_calls
        assert out.choices[0].finish_reason == "tool_calls"
        assert (got.function.name, json.loads(got.function.arguments)) == (
            "rain", call["arguments"])  # fmt: skip
        streamed = [c.choices[0].delta for c in client.chat.completions.create(**asked,
                    stream=True) if c.choices]  # fmt: skip
        calls = [d.tool_calls[0] for d in streamed if d.tool_calls]
        assert [(c.function.name, c.function.arguments) for c in calls] == [
            (got.function.name, got.function.arguments)]  # fmt: skip
        assert not "".join(d.content or "" for d in streamed).strip()
