"""axplug-structured through the Engine and through `axplug serve` with the openai client: every
JSON output validated by jsonschema, choices, regexes and grammars matched, greedy guided
tokens checked to be the model's most likely allowed token, and bad specs one 400 each."""

from __future__ import annotations

import json
import re

import jsonschema
import numpy as np
import pytest
from axplug_structured import LLGuidanceGuide

from axplug.api.data import load_tokenizer
from axplug.api.run import Engine, Request, SamplingParams, find_tokenizer, load_checkpoint

# Nested, with arrays, enums, bounds and required fields; bounded, so every output fits.
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["king", "queen", "fool"]},
        "scenes": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {
                    "act": {"type": "integer", "minimum": 1, "maximum": 5},
                    "mood": {"enum": ["sad", "glad"]},
                },
                "required": ["act", "mood"],
                "additionalProperties": False,
            },
            "minItems": 1,
            "maxItems": 2,
        },
    },
    "required": ["name", "role", "scenes"],
    "additionalProperties": False,
}
MAX_TOKENS = 200  # bytes: the longest output SCHEMA allows is shorter
PROMPT = "KING. Speak, and tell me"


@pytest.fixture(scope="module")
def run_dir(trained_run):
    return trained_run("llama-tiny", "input.seq_len=64")  # the serve tests' run


@pytest.fixture(scope="module")
def loaded(run_dir):
    return load_checkpoint(run_dir)


@pytest.fixture(scope="module")
def guide(loaded, run_dir):
    guide = LLGuidanceGuide.default_config().instantiate()
    guide.bind(find_tokenizer(loaded, run_dir), loaded.model.config.decoder.vocab_size)
    return guide


def test_greedy_guided_tokens_are_the_best_allowed_ones(loaded, run_dir, guide):
    """Each greedy token is the argmax of the model's logits over the tokens a fresh matcher,
    walked through the same output, allows; the text validates."""
    tokenizer = find_tokenizer(loaded, run_dir)
    prompt = tokenizer.encode(PROMPT)
    make = guide.compile("json_schema", SCHEMA)
    engine = Engine(loaded.model, loaded.params, num_slots=2, max_len=256)
    engine.submit(Request(prompt, SamplingParams(max_new_tokens=MAX_TOKENS, temperature=0),
                          constraint=make()))  # fmt: skip
    (done,) = engine.run()
    assert done.finish_reason == "stop"
    jsonschema.validate(json.loads(tokenizer.decode(done.output_ids)), SCHEMA)
    logits = np.asarray(loaded.logits(np.asarray([prompt + done.output_ids])))[0]
    replay, vocab = make(), logits.shape[-1]
    words = np.zeros((vocab + 31) // 32, np.int32)
    for i, token in enumerate(done.output_ids):
        replay.fill(words)
        allowed = np.unpackbits(words.view(np.uint8), bitorder="little")[:vocab].astype(bool)
        best = np.flatnonzero(allowed)[np.argmax(logits[len(prompt) - 1 + i][allowed])]
        assert token == best, (i, token, best)
        replay.accept(token)


def test_an_hf_tokenizer_masks_tokens_by_their_text(tmp_path):
    """A byte-level BPE tokenizer.json: the first allowed tokens of a choice are exactly the
    tokens whose text starts one of the choices (or is one's prefix)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["</s>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())  # fmt: skip
    tok.train_from_iterator(["yes no maybe yesterday nothing"] * 50, trainer=trainer)
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text('{"eos_token": "</s>"}')
    tokenizer = load_tokenizer(tmp_path / "tokenizer.json")
    guide = LLGuidanceGuide.default_config().instantiate()
    guide.bind(tokenizer, tokenizer.vocab_size)
    constraint = guide.compile("choice", ["yes", "no"])()
    words = np.zeros((tokenizer.vocab_size + 31) // 32, np.int32)
    constraint.fill(words)
    bits = np.unpackbits(words.view(np.uint8), bitorder="little")[: tokenizer.vocab_size]
    texts = {t: tokenizer.decode([t]) for t in range(tokenizer.vocab_size)}
    want = {t for t, s in texts.items() if s and any(c.startswith(s) for c in ("yes", "no"))}
    assert set(np.flatnonzero(bits).tolist()) == want
    yes = tokenizer.encode("yes")
    assert [constraint.accept(t) for t in yes] == [False] * (len(yes) - 1) + [True]


def test_bad_specs_and_unsupported_tokenizers_are_value_errors(guide):
    with pytest.raises(ValueError, match="json_schema: .*bogus"):
        guide.compile("json_schema", {"type": "bogus"})
    with pytest.raises(ValueError, match="regex: "):
        guide.compile("regex", "(unclosed")
    with pytest.raises(ValueError, match="choice: give a non-empty list of strings"):
        guide.compile("choice", [])

    class Other:
        source = None
        vocab_size = 10

        def describe(self):
            return "other (vocab 10)"

    with pytest.raises(ValueError, match="need the byte tokenizer or a Hugging Face"):
        LLGuidanceGuide.default_config().instantiate().bind(Other(), 10)


# --- through the server ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def client(run_dir, tmp_path_factory):
    openai = pytest.importorskip("openai")
    pytest.importorskip("axplug_serve")
    from axplug_serve.testing import serve_in_thread

    log = tmp_path_factory.mktemp("structured-serve") / "server.log"
    # Room for the tools in a prompt and a reply (bytes: the tool tests' prompts are up to 684
    # tokens). 16-token prefill chunks: every prefill runs at one width, so each kind of
    # request (constrained or not, with logprobs or not) compiles two programs, not four.
    options = ["--checkpoint", str(run_dir), "--num-slots", "16", "--max-len", "768",
               "--prefill-chunk", "16", "--log-level", "warning", "--no-warmup"]  # fmt: skip
    with serve_in_thread(options, log) as base:
        yield openai.OpenAI(base_url=base + "/v1", api_key="-", max_retries=0, timeout=300)


def _json_format(schema):
    return {
        "type": "json_schema",
        "json_schema": {"name": "cast", "schema": schema, "strict": True},
    }


def test_a_hundred_sampled_completions_validate_also_streamed(client):
    outputs = []
    for seed in range(7):  # 7 x 16 choices; one request with the model's logprobs
        out = client.chat.completions.create(
            model=client.models.list().data[0].id, n=16, seed=seed, temperature=1.0,
            messages=[{"role": "user", "content": PROMPT}], max_tokens=MAX_TOKENS,
            response_format=_json_format(SCHEMA), logprobs=seed == 0,
        )  # fmt: skip
        outputs += [(c.message.content, c.finish_reason) for c in out.choices]
        if seed == 0:
            counted = sum(len(c.logprobs.content) for c in out.choices)
            assert counted == out.usage.completion_tokens
    assert len(outputs) >= 100 and {reason for _, reason in outputs} == {"stop"}
    for text, _ in outputs:
        jsonschema.validate(json.loads(text), SCHEMA)
    # Streamed (the completions endpoint, vLLM's guided_json): the deltas assemble to the
    # text of the same request unstreamed.
    asked = dict(
        model=client.models.list().data[0].id, prompt=PROMPT, n=4, seed=9, temperature=1.0,
        max_tokens=MAX_TOKENS, extra_body={"guided_json": SCHEMA},
    )  # fmt: skip
    whole = client.completions.create(**asked)
    streamed = [""] * 4
    for chunk in client.completions.create(**asked, stream=True):
        for choice in chunk.choices:
            streamed[choice.index] += choice.text
    assert streamed == [c.text for c in whole.choices]
    for text in streamed:
        jsonschema.validate(json.loads(text), SCHEMA)


@pytest.mark.parametrize(
    "extra, check",
    [
        (
            {"guided_choice": ["to be", "not to be", "perchance"]},
            lambda t: t in ("to be", "not to be", "perchance"),
        ),
        (
            {"guided_regex": r"[A-Z][a-z]{1,6} [0-9]{1,3}"},
            lambda t: re.fullmatch(r"[A-Z][a-z]{1,6} [0-9]{1,3}", t),
        ),
        (
            {
                "guided_grammar": 'start: pair | one\npair: "(" NUM "," NUM ")"\none: "(" NUM ")"\n'
                "NUM: /[0-9]{1,2}/"
            },
            lambda t: re.fullmatch(r"\(\d{1,2}(,\d{1,2})?\)", t),
        ),
        ({"response_format": {"type": "json_object"}}, lambda t: isinstance(json.loads(t), dict)),
    ],
    ids=["choice", "regex", "grammar", "json_object"],
)
def test_choices_regexes_grammars_and_json_objects_always_match(client, extra, check):
    out = client.chat.completions.create(
        model=client.models.list().data[0].id, n=16, seed=3, temperature=1.0,
        messages=[{"role": "user", "content": PROMPT}], max_tokens=40, extra_body=extra,
    )  # fmt: skip
    for choice in out.choices:
        # Any JSON object is unbounded: it may run out of tokens; the others end by themselves.
        assert choice.finish_reason == "stop" or "response_format" in extra, choice
        if choice.finish_reason == "stop":
            assert check(choice.message.content), choice.message.content
    assert any(choice.finish_reason == "stop" for choice in out.choices)


@pytest.mark.parametrize(
    "extra, message",
    [
        ({"response_format": {"type": "xml"}}, "response_format.type: 'xml' is not"),
        ({"response_format": {"type": "json_schema"}}, "json_schema.schema: give the schema"),
        ({"response_format": _json_format({"type": "bogus"})}, "response_format: json_schema"),
        ({"guided_regex": "(x", "guided_choice": ["a"]}, "ask for one structured output"),
        ({"guided_json": "{not json"}, "guided_json: not valid JSON"),
    ],
)
def test_bad_structured_requests_are_400_naming_the_field(client, extra, message):
    import openai

    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(
            model=client.models.list().data[0].id, max_tokens=4,
            messages=[{"role": "user", "content": "hi"}], extra_body=extra,
        )  # fmt: skip
    assert message in caught.value.body["message"], caught.value.body


# --- tool calls -----------------------------------------------------------------------------

TOOLS = [
    {"type": "function", "function": {
        "name": "weather", "description": "The weather in a city.",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string", "maxLength": 10},
            "unit": {"enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"], "additionalProperties": False}}},
    {"type": "function", "function": {
        "name": "hour", "parameters": {"type": "object", "properties": {
            "zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
            "additionalProperties": False}}},
]  # fmt: skip
PARAMETERS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


def _chat(client, **kwargs):
    asked = dict(model=client.models.list().data[0].id, temperature=1.0, max_tokens=120,
                 messages=[{"role": "user", "content": "Is it raining in Elsinore?"}])  # fmt: skip
    return client.chat.completions.create(**{**asked, **kwargs})


@pytest.mark.parametrize("choice", ["required", "hour"])
def test_a_forced_tool_call_always_parses_and_validates(client, choice):
    tool_choice = choice if choice == "required" else {
        "type": "function", "function": {"name": choice}}  # fmt: skip
    out = _chat(client, tools=TOOLS, tool_choice=tool_choice, parallel_tool_calls=False, n=16,
                seed=1)  # fmt: skip
    for c in out.choices:  # the openai client's types parsed every field
        assert c.finish_reason == "tool_calls" and c.message.content is None, c
        (call,) = c.message.tool_calls
        assert call.type == "function" and call.id.startswith("call_")
        assert call.function.name == choice or choice == "required"
        jsonschema.validate(json.loads(call.function.arguments), PARAMETERS[call.function.name])


def test_a_streamed_tool_call_assembles_to_the_whole_message(client):
    asked = dict(tools=TOOLS, tool_choice="required", parallel_tool_calls=False, n=2, seed=4)
    whole = _chat(client, **asked)
    content, calls = ["", ""], [{}, {}]
    finish = [None, None]
    for chunk in _chat(client, **asked, stream=True):
        for c in chunk.choices:
            content[c.index] += c.delta.content or ""
            for call in c.delta.tool_calls or ():
                got = calls[c.index].setdefault(call.index, {"name": "", "arguments": ""})
                got["name"] += call.function.name or ""
                got["arguments"] += call.function.arguments or ""
            finish[c.index] = c.finish_reason or finish[c.index]
    for i, choice in enumerate(whole.choices):
        assert content[i] == (choice.message.content or "")
        assert finish[i] == choice.finish_reason == "tool_calls"
        want = [{"name": t.function.name, "arguments": t.function.arguments}
                for t in choice.message.tool_calls]  # fmt: skip
        assert [calls[i][k] for k in sorted(calls[i])] == want


def test_tool_results_come_back_as_tool_messages(client):
    messages = [
        {"role": "user", "content": "Is it raining in Elsinore?"},
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": "call_1", "type": "function",
            "function": {"name": "weather", "arguments": '{"city": "Elsinore", "unit": "celsius"}'},
        }]},
        {"role": "tool", "tool_call_id": "call_1", "content": "Rain, 9 degrees."},
    ]  # fmt: skip
    out = _chat(client, messages=messages, tools=TOOLS, max_tokens=8, temperature=0)
    assert out.choices[0].message.role == "assistant"
    plain = _chat(client, messages=messages, tools=TOOLS, tool_choice="none", max_tokens=8,
                  temperature=0)  # fmt: skip
    assert plain.choices[0].message.tool_calls is None


@pytest.mark.parametrize("parser", ["hermes", "llama3_json"])
def test_every_sentence_of_a_tool_grammar_parses_to_valid_calls(guide, parser):
    """Random walks through each format's forced-call grammar (the byte vocabulary) parse to
    one call of a tool, its arguments valid; two calls in a row are a sentence in parallel."""
    from axplug.api import registry

    formats = registry.load("tool_parsers", parser)()
    rng = np.random.default_rng(0)
    make = guide.compile("grammar", formats.grammar(TOOLS, False))
    for _ in range(20):
        constraint, words, out = make(), np.zeros(8, np.int32), []
        while True:
            constraint.fill(words)
            bits = np.unpackbits(words.view(np.uint8), bitorder="little")
            out.append(int(rng.choice(np.flatnonzero(bits))))
            if constraint.accept(out[-1]):
                break
        content, (call,) = formats.parse(bytes(out).decode())
        assert content == ""
        jsonschema.validate(json.loads(call["arguments"]), PARAMETERS[call["name"]])
    key = "arguments" if parser == "hermes" else "parameters"
    one = json.dumps({"name": "hour", key: {"zone": "UTC"}})
    block = f"<tool_call>\n{one}\n</tool_call>"
    two = f"{block}\n{block}" if parser == "hermes" else f"{one}; {one}"
    parallel = guide.compile("grammar", formats.grammar(TOOLS, True))()
    assert [parallel.accept(t) for t in two.encode()][-1] is False  # more calls may follow
    assert len(formats.parse(two)[1]) == 2
