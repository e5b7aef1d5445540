"""axplug-serve: `axplug serve` on loopback, driven by the real OpenAI client."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import numpy as np
import pytest

pytest.importorskip("axplug_serve")
openai = pytest.importorskip("openai")

from axplug_serve.text import ChatTemplate, TextStream  # noqa: E402
from axplug_testing import cli_main as main  # noqa: E402

from axplug.api.run import (
    Engine,
    Request,
    SamplingParams,
    find_tokenizer,
    load_checkpoint,
)

MAX_LEN = 256
KEY = "test-key"
MAX_BODY = 1 << 16
_LOGS: dict[str, object] = {}  # server URL -> its log file


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory, trained_run):
    from axplug_testing import copy_run

    llama_tiny = trained_run("llama-tiny", "input.seq_len=64")  # shared with other modules
    return str(copy_run(llama_tiny, tmp_path_factory.mktemp("served") / "tiny"))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str, body: dict | bytes | None = None, key: str | None = KEY, method=None):
    """(status, text, headers) of a request: GET, or POST of `body` (JSON unless bytes)."""
    data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, method=method)
    request.add_header("Content-Type", "application/json")
    if key is not None:
        request.add_header("Authorization", f"Bearer {key}")
    try:
        with urllib.request.urlopen(request, timeout=60) as r:
            return r.status, r.read().decode(), r.headers
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode(), e.headers


def _serve_argv(run_dir: str, *extra: str) -> list[str]:
    """`axplug serve` with 2 slots, 2 queued, API key KEY."""
    return ["serve", "--checkpoint", run_dir, "--num-slots", "2", "--max-queue", "2",
            "--max-len", str(MAX_LEN), "--log-level", "warning", "--api-key", KEY,
            "--max-body-bytes", str(MAX_BODY), *extra]  # fmt: skip


@contextlib.contextmanager
def _serve(run_dir, tmp_path_factory, *extra):
    """`axplug serve` in its own process, stopped by its PID: it exits 0 on SIGTERM."""
    port = _free_port()
    log = tmp_path_factory.mktemp("serve-log") / "server.log"
    cmd = [sys.executable, "-m", "axplug.cli", *_serve_argv(run_dir, *extra), "--port", str(port)]
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 240
        while True:
            try:
                if _get(base + "/health", key=None)[0] == 200:
                    break
            except OSError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"axplug serve did not start:\n{log.read_text()}")
            time.sleep(0.5)
        paged = "--kv-cache" not in extra
        max_len = int(extra[extra.index("--max-len") + 1]) if "--max-len" in extra else MAX_LEN
        pages = 2 * max_len // 16  # 2 rows of 16-token pages
        assert _metric(base, "axplug_serve_kv_pages_free") == (pages if paged else -1)
        yield base
    finally:
        os.kill(proc.pid, signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 0, log.read_text()  # a graceful stop on SIGTERM
    assert "Traceback" not in log.read_text(), log.read_text()


@pytest.fixture(scope="module")
def server(run_dir, tmp_path_factory):
    """The app `axplug serve` builds, on a uvicorn thread of this process (no interpreter of
    its own to start: `_serve` runs the command itself), its log in a file."""
    from axplug_serve.testing import serve_in_thread

    log = tmp_path_factory.mktemp("serve-log") / "server.log"
    # 16-token prefill chunks: the warm-up compiles one prefill width, not five, and prefills a
    # longer prompt beside a decoding row; longer prompts (most of the tests') are chunked, and
    # every prefill runs at the width the warm-up compiled.
    options = _serve_argv(run_dir, "--prefill-chunk", "16")[1:]
    with serve_in_thread(options, log) as base:
        # The engine's gauges are there before any request (2 rows x 256 / 16 pages).
        assert _metric(base, "axplug_serve_kv_pages_free") == 32
        _LOGS[base] = log
        yield base


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key=KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def loaded(run_dir):
    return load_checkpoint(run_dir)


@pytest.fixture(scope="module")
def engine(loaded):
    """The core's Engine over the same checkpoint, in this process: one for every reference
    below, so its programs are compiled once (3 rows of 64 tokens in 16-token prefill chunks:
    the shape of the eval plugin's engine over this run, whose programs the session then
    compiles once too; every prompt prefills at the one width 16)."""
    return Engine(loaded.model, loaded.params, num_slots=3, max_len=64, prefill_chunk=16)


@pytest.fixture(scope="module")
def reference(run_dir, loaded, engine):
    """Greedy ids of the same checkpoint, decoded in this process by the core's Engine."""
    tokenizer = find_tokenizer(loaded, run_dir)

    def greedy(prompt_ids: list[int], n: int) -> list[int]:
        engine.submit(Request(prompt_ids, SamplingParams(max_new_tokens=n, temperature=0)))
        (completion,) = engine.run()
        return completion.output_ids

    return tokenizer, greedy


def _metric(base: str, name: str) -> float:
    from axplug_serve.testing import metric_value

    return metric_value(_get(base + "/metrics")[1], name)


def _wait_idle(base: str) -> None:
    deadline = time.monotonic() + 60
    while json.loads(_get(base + "/health")[1])["in_flight"]:
        assert time.monotonic() < deadline, "requests never finished"
        time.sleep(0.05)


def test_greedy_completion_equals_the_engine(server, client, reference):
    tokenizer, greedy = reference
    prompt = "HAMLET. To be"
    out = client.completions.create(model="tiny", prompt=prompt, max_tokens=24, temperature=0)
    want = greedy(tokenizer.encode(prompt), 24)
    assert out.choices[0].text == tokenizer.decode(want)
    assert out.choices[0].finish_reason == "length" and out.object == "text_completion"
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (len(prompt), 24)
    ids = [5, 17, 99, 3]  # a prompt given as token ids
    out = client.completions.create(model="tiny", prompt=ids, max_tokens=8, temperature=0)
    assert out.choices[0].text == tokenizer.decode(greedy(ids, 8))
    (card,) = client.models.list().data
    assert (card.id, card.model_extra["max_model_len"]) == ("tiny", MAX_LEN)


def test_streamed_chat_equals_the_whole_reply(server, client, reference):
    tokenizer, greedy = reference
    messages = [{"role": "user", "content": "Who is there?"}]
    whole = client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=20, temperature=0
    )
    prompt = tokenizer.encode("user: Who is there?\n\nassistant:")  # the default template
    assert whole.choices[0].message.content == tokenizer.decode(greedy(prompt, 20))
    assert whole.usage.prompt_tokens == len(prompt)
    chunks = list(
        client.chat.completions.create(
            model="tiny",
            messages=messages,
            max_tokens=20,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 20 and not chunks[-1].choices
    assert len({c.id for c in chunks}) == 1


def test_chat_responses_name_the_template_they_rendered(server, client):
    origin = client.models.list().data[0].model_extra["chat_template"]
    assert origin
    messages = [{"role": "user", "content": "Who is there?"}]
    for stream in (False, True):
        raw = client.chat.completions.with_raw_response.create(
            model="tiny", messages=messages, max_tokens=2, temperature=0, stream=stream
        )
        assert raw.headers["x-axplug-chat-template"] == origin
        raw.parse()


def test_a_stop_string_ends_the_text_before_it(server, client):
    full = client.completions.create(model="tiny", prompt="To be", max_tokens=40, temperature=0)
    text = full.choices[0].text
    stop = next(text[i : i + 2] for i in range(5, len(text) - 2) if text[i : i + 2].strip())
    out = client.completions.create(
        model="tiny", prompt="To be", max_tokens=40, temperature=0, stop=[stop, "never seen"]
    )
    assert out.choices[0].text == text[: text.find(stop)]
    assert out.choices[0].finish_reason == "stop"
    streamed = client.completions.create(
        model="tiny", prompt="To be", max_tokens=40, temperature=0, stop=stop, stream=True
    )
    assert "".join(c.choices[0].text for c in streamed) == text[: text.find(stop)]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"temperature": 5}, "temperature: Input should be less than or equal to 2"),
        ({"n": 17}, "n: Input should be less than or equal to 16"),
        ({"top_p": 0}, "top_p: Input should be greater than 0"),
        ({"extra_body": {"top_k": 2**31}}, "top_k: Input should be less than or equal to 2147"),
        ({"seed": 2**64}, "seed: Input should be less than 4294967296"),
        ({"logprobs": 21}, "logprobs: Input should be less than or equal to 20"),
        ({"max_tokens": 0}, "max_tokens: 0 needs echo=true"),
        ({"prompt": [[1], []]}, "prompt: Value error, the prompt is empty"),
        ({"presence_penalty": 3}, "presence_penalty: Input should be less than or equal to 2"),
        ({"logit_bias": {"x": 1}}, "logit_bias: Value error, key 'x' is not a token id"),
        ({"logit_bias": {"300": 1}}, "token id 300 is outside the model's vocabulary"),
        ({"stream_options": {"include_usage": True}}, "stream_options: only allowed with stream"),
        ({"max_tokens": MAX_LEN}, "maximum context length is 256 tokens"),
        ({"prompt": [1, 999]}, "token id 999 is outside the model's vocabulary [0, 256)"),
        ({"prompt": ""}, "prompt: Value error, the prompt is empty"),
    ],
)
def test_bad_requests_are_400_naming_the_field(server, client, kwargs, message):
    kwargs = {"model": "tiny", "prompt": "hi", **kwargs}
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(**kwargs)
    assert message.replace("Value error, ", "") in info.value.message


def test_malformed_bodies_and_nulls(server, client):
    status, text, _ = _get(server + "/v1/completions", b'{"model": "tiny", "prompt": "hi",,}')
    error = json.loads(text)["error"]
    assert status == 400 and error["param"] is None
    assert error["message"].startswith("the request body is not valid JSON (at character")
    # Explicit nulls mean the defaults, as in OpenAI's API.
    out = client.completions.create(
        model="tiny", prompt="hi", max_tokens=2, extra_body={"temperature": None, "n": None}
    )
    assert out.usage.completion_tokens == 2


def test_unknown_model_is_404(server, client):
    with pytest.raises(openai.NotFoundError, match="this server serves 'tiny'"):
        client.completions.create(model="gpt-4", prompt="hi")
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4")


def test_a_client_that_disconnects_cancels_its_request(server, client):
    before = _metric(server, "axplug_serve_requests_total")
    cancelled = 'axplug_serve_requests_total{endpoint="completions",finish_reason="cancelled"}'
    stream = client.completions.create(model="tiny", prompt="To be", max_tokens=200, stream=True)
    for i, _ in enumerate(stream):
        if i == 2:
            break
    stream.close()
    _wait_idle(server)  # the engine dropped it long before 200 tokens
    text = _get(server + "/metrics")[1]
    line = next(line for line in text.splitlines() if line.startswith(cancelled))
    assert float(line.split()[-1]) == 1
    assert _metric(server, "axplug_serve_requests_total") == before + 1
    assert _metric(server, "axplug_serve_generation_tokens_total") > 0
    assert _metric(server, "axplug_serve_requests_running") == 0


def test_a_full_queue_is_429_and_the_server_recovers(server, client):
    # 2 slots + 2 queued: four long requests in flight, the fifth is refused.
    streams = [
        client.completions.create(model="tiny", prompt="To be", max_tokens=240, stream=True)
        for _ in range(4)
    ]
    with pytest.raises(openai.RateLimitError, match="at capacity"):
        client.completions.create(model="tiny", prompt="x", max_tokens=2)
    assert _metric(server, 'axplug_serve_rejected_requests_total{status="429"}') >= 1
    for stream in streams:
        stream.close()
    _wait_idle(server)
    out = client.completions.create(model="tiny", prompt="x", max_tokens=2)
    assert out.usage.completion_tokens == 2


def test_health_models_and_help(server, client, capsys):
    status, body, _ = _get(server + "/health")
    assert status == 200 and json.loads(body)["status"] == "ok"
    client.completions.create(model="tiny", prompt="x", max_tokens=1)  # a first token timed
    assert re.search(r"^axplug_serve_time_to_first_token_seconds_count [1-9]", _get(
        server + "/metrics")[1], re.M)  # fmt: skip
    assert main(["--help"]) == 0
    assert re.search(r"serve\s+an OpenAI-compatible HTTP server", capsys.readouterr().out)
    assert main(["list", "--kind", "commands"]) == 0
    assert re.search(r"axplug-serve\s+\S+\s+commands\s+serve\s+ok", capsys.readouterr().out)


@pytest.mark.parametrize(
    "extra",
    [
        # The decode side verifies prompt-lookup drafts. No warm-up (each side compiles only
        # the programs of the one request): test_disaggregated.py warms up a disaggregated
        # engine as this command does.
        ["--prefill-devices", "4", "--max-len", "64", "--no-warmup"]
        + ["--speculative", "ngram:min_n=1"],
        # Chunked prefill with either cache is covered in-process (test_inference.py).
        pytest.param(["--kv-cache", "contiguous", "--prefill-chunk", "4"], marks=pytest.mark.slow),
    ],
    ids=["disaggregated", "contiguous-chunked"],
)
def test_other_engines_serve_the_same_text(run_dir, tmp_path_factory, reference, extra):
    tokenizer, greedy = reference
    with _serve(run_dir, tmp_path_factory, *extra) as base:
        client = openai.OpenAI(base_url=base + "/v1", api_key=KEY, max_retries=0, timeout=120)
        prompt = "HAMLET. To be, or not to be"
        out = client.completions.create(model="tiny", prompt=prompt, max_tokens=16, temperature=0)
        if "--speculative" in extra:
            proposed = _metric(base, "axplug_serve_spec_proposed_tokens_total")
            assert proposed >= _metric(base, "axplug_serve_spec_accepted_tokens_total") > 0
    assert out.choices[0].text == tokenizer.decode(greedy(tokenizer.encode(prompt), 16))


def test_serve_errors_before_listening(tmp_path, capsys):
    assert main(["serve", "--checkpoint", str(tmp_path)]) == 1
    assert "error: no complete checkpoint" in capsys.readouterr().err
    assert main(["serve", "--checkpoint", str(tmp_path), "--port", "70000"]) == 2
    assert "expected a TCP port 0-65535, got '70000'" in capsys.readouterr().err
    assert main(["serve", "--checkpoint", str(tmp_path), "--prefill-devices", "-1"]) == 2
    assert "--prefill-devices -1: must be at least 0" in capsys.readouterr().err
    with socket.socket() as taken:  # a busy port is found before the model is loaded
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        assert main(["serve", "--checkpoint", str(tmp_path), "--port", port]) == 1
    assert f"cannot listen on 127.0.0.1:{port}" in capsys.readouterr().err


def _post(base: str, path: str, body: dict, key: str | None = KEY) -> dict:
    status, text, _ = _get(base + path, body, key)
    assert status == 200, text
    return json.loads(text)


def _engine_scores(engine, prompts: list[list[int]], new: int, top: int):
    """The core Engine's greedy completions of `prompts` with output and prompt logprobs."""
    sampling = SamplingParams(max_new_tokens=new, temperature=0, logprobs=top, prompt_logprobs=top)
    for i, prompt in enumerate(prompts):
        engine.submit(Request(prompt, sampling, id=i))
    done = {c.id: c for c in engine.run()}
    return [done[i] for i in range(len(prompts))]


def test_echo_logprobs_equal_the_engines_for_prompt_and_output(server, engine, reference):
    tokenizer, _ = reference
    prompts = ["HAMLET. To be", "KING."]
    args = {"prompt": prompts, "echo": True, "max_tokens": 4, "logprobs": 2, "temperature": 0}
    body = _post(server, "/v1/completions", {"model": "tiny", **args})
    wants = _engine_scores(engine, [tokenizer.encode(p) for p in prompts], 4, 2)
    assert [c["index"] for c in body["choices"]] == [0, 1]
    for prompt, choice, want in zip(prompts, body["choices"], wants, strict=True):
        ids = want.prompt_ids + want.output_ids
        assert choice["text"] == prompt + tokenizer.decode(want.output_ids)
        got = choice["logprobs"]
        assert got["tokens"] == [tokenizer.decode([t]) for t in ids]
        assert got["token_logprobs"][0] is None and got["top_logprobs"][0] is None
        entries = want.prompt_logprobs[1:] + want.output_logprobs
        np.testing.assert_allclose(got["token_logprobs"][1:], [e.logprob for e in entries],
                                   rtol=0, atol=1e-5)  # fmt: skip
        for entry, top in zip(entries, got["top_logprobs"][1:], strict=True):
            # The token itself and its two most likely, keyed by text.
            texts = {tokenizer.decode([t]) for t in (entry.token, *[t for t, _ in entry.top])}
            assert set(top) == texts
            assert max(top.values()) == pytest.approx(entry.top[0][1], abs=1e-5)
        offsets = got["text_offset"]
        assert offsets == [sum(map(len, got["tokens"][:i])) for i in range(len(ids))]
    assert body["usage"]["completion_tokens"] == 8

    # Scoring only (lm-eval's loglikelihood): max_tokens 0, the prompt given as ids.
    ids = wants[0].prompt_ids
    body = _post(server, "/v1/completions", {"model": "tiny", "prompt": ids, "echo": True,
                                            "max_tokens": 0, "logprobs": 0,
                                            "prompt_logprobs": 1})  # fmt: skip
    (choice,) = body["choices"]
    assert choice["text"] == tokenizer.decode(ids) and body["usage"]["completion_tokens"] == 0
    want = [e.logprob for e in wants[0].prompt_logprobs[1:]]
    np.testing.assert_allclose(choice["logprobs"]["token_logprobs"][1:], want, atol=1e-5)
    # vLLM's prompt_logprobs: None, then {id: {logprob, rank, decoded_token}} per token.
    vllm = choice["prompt_logprobs"]
    assert vllm[0] is None and len(vllm) == len(ids)
    for token, entry, ranked in zip(ids[1:], wants[0].prompt_logprobs[1:], vllm[1:], strict=True):
        assert ranked[str(token)]["rank"] == entry.rank
        assert ranked[str(token)]["decoded_token"] == tokenizer.decode([token])
        assert ranked[str(entry.top[0][0])]["rank"] == 1


def test_streamed_logprobs_and_chat_logprobs(server, client, engine, reference):
    tokenizer, _ = reference
    _wait_idle(server)
    args = {"model": "tiny", "prompt": "To be", "max_tokens": 12, "logprobs": 1, "temperature": 0}
    whole = client.completions.create(**args).choices[0].logprobs
    chunks = [c.choices[0] for c in client.completions.create(**args, stream=True) if c.choices]
    parts = [c.logprobs for c in chunks if c.logprobs is not None]
    assert sum((p.tokens for p in parts), []) == whole.tokens
    # Within float32 rounding: a step's company (in the full suite, a request of an earlier
    # test still finishing) moves a logprob's last bits (bench/RESULTS.md, batch invariance).
    np.testing.assert_allclose(sum((p.token_logprobs for p in parts), []),
                               whole.token_logprobs, rtol=0, atol=1e-5)  # fmt: skip
    assert sum((p.text_offset for p in parts), []) == whole.text_offset
    assert chunks[-1].finish_reason == "length" and chunks[-1].logprobs is None

    messages = [{"role": "user", "content": "Who is there?"}]
    out = client.chat.completions.create(model="tiny", messages=messages, max_tokens=5,
                                         temperature=0, logprobs=True, top_logprobs=2)  # fmt: skip
    prompt = tokenizer.encode("user: Who is there?\n\nassistant:")
    (want,) = _engine_scores(engine, [prompt], 5, 2)
    content = out.choices[0].logprobs.content
    assert [c.token for c in content] == [tokenizer.decode([t]) for t in want.output_ids]
    np.testing.assert_allclose([c.logprob for c in content],
                               [e.logprob for e in want.output_logprobs], atol=1e-5)  # fmt: skip
    for c, entry in zip(content, want.output_logprobs, strict=True):
        assert [t.token for t in c.top_logprobs] == [tokenizer.decode([t]) for t, _ in entry.top]
        assert c.bytes == list(c.token.encode())
    plain = client.chat.completions.create(model="tiny", messages=messages, max_tokens=2)
    assert plain.choices[0].logprobs is None


def test_list_prompts_and_n_choices(server, client, reference):
    tokenizer, greedy = reference
    prompts = ["To be", "HAMLET."]
    out = client.completions.create(model="tiny", prompt=prompts, max_tokens=6, temperature=0)
    assert [c.index for c in out.choices] == [0, 1]
    for prompt, choice in zip(prompts, out.choices, strict=True):
        assert choice.text == tokenizer.decode(greedy(tokenizer.encode(prompt), 6))
    assert out.usage.prompt_tokens == sum(len(tokenizer.encode(p)) for p in prompts)
    sampled = dict(model="tiny", prompt=prompts, max_tokens=8, temperature=1.0, n=2, seed=5)
    first, again = client.completions.create(**sampled), client.completions.create(**sampled)
    texts = [c.text for c in sorted(first.choices, key=lambda c: c.index)]
    assert len(texts) == 4 and texts == [c.text for c in sorted(again.choices,
                                                                key=lambda c: c.index)]  # fmt: skip
    assert texts[0] != texts[1]  # the n choices of a prompt are separate samples
    assert first.usage.completion_tokens == 32
    streamed = client.completions.create(**sampled, stream=True)
    by_index: dict[int, str] = {}
    for chunk in streamed:
        for choice in chunk.choices:
            by_index[choice.index] = by_index.get(choice.index, "") + choice.text
    assert [by_index[i] for i in range(4)] == texts
    with pytest.raises(openai.BadRequestError, match="runs at most 4 at once"):
        client.completions.create(model="tiny", prompt=prompts * 3, max_tokens=2)


def test_shared_prefixes_read_cached_pages_and_every_page_comes_back(server, client, reference):
    """Prefix caching (on by default): requests after one long prefix read its cached pages,
    answer as the Engine does without a cache to share (the reference is contiguous), and when
    the load is done every page is free again (idle cached ones count as free); /metrics has
    the hits, the cached pages and the hit rate's denominator."""
    tokenizer, greedy = reference
    head = "HAMLET. To be, or not to be, that is the question: "  # the engine's max_len is 64
    hits, queries = (
        _metric(server, f"axplug_serve_prefix_cache_{m}_total") for m in ("hits", "queries")
    )
    prompts = [head + end for end in ("to die", "to end", "to sleep")]
    for prompt in prompts:  # one after another: each later one finds the head's pages cached
        out = client.completions.create(model="tiny", prompt=prompt, max_tokens=6, temperature=0)
        assert out.choices[0].text == tokenizer.decode(greedy(tokenizer.encode(prompt), 6))
    sampled = client.completions.create(model="tiny", prompt=prompts[0], max_tokens=4, n=2,
                                        temperature=1.0, seed=3)  # fmt: skip
    assert len(sampled.choices) == 2
    full_pages = (len(tokenizer.encode(head)) - 1) // 16
    assert full_pages >= 2
    # The 2nd and 3rd prompts, and both choices of the 4th, read at least the head's pages.
    assert _metric(server, "axplug_serve_prefix_cache_hits_total") - hits >= 4 * full_pages * 16
    prompt_tokens = sum(len(tokenizer.encode(p)) for p in [*prompts, *prompts[:1] * 2])
    assert _metric(server, "axplug_serve_prefix_cache_queries_total") - queries == prompt_tokens
    _wait_idle(server)
    assert _metric(server, "axplug_serve_kv_pages_free") == 32
    assert _metric(server, "axplug_serve_kv_pages_cached") >= full_pages


def test_penalties_and_logit_bias_equal_the_engines(server, client, engine, reference):
    tokenizer, _ = reference
    forced = client.completions.create(model="tiny", prompt="To be", max_tokens=5,
                                       temperature=0, logit_bias={"65": 100})  # fmt: skip
    assert forced.choices[0].text == "AAAAA"
    settings = {"presence_penalty": 1.5, "frequency_penalty": 0.5}
    out = client.completions.create(model="tiny", prompt="To be", max_tokens=12,
                                    temperature=0, **settings,
                                    extra_body={"repetition_penalty": 1.3})  # fmt: skip
    sampling = SamplingParams(max_new_tokens=12, temperature=0, repetition_penalty=1.3,
                              **settings)  # fmt: skip
    engine.submit(Request(tokenizer.encode("To be"), sampling))
    (want,) = engine.run()
    assert out.choices[0].text == tokenizer.decode(want.output_ids)


def test_tokenizer_endpoints(server, reference):
    tokenizer, _ = reference
    out = _post(server, "/tokenize", {"prompt": "Héllo", "add_special_tokens": False})
    assert out == {"tokens": tokenizer.encode("Héllo"), "count": 6, "max_model_len": MAX_LEN}
    chat = _post(server, "/tokenize", {"messages": [{"role": "user", "content": "hi"}]})
    assert chat["tokens"] == tokenizer.encode("user: hi\n\nassistant:")
    assert _post(server, "/detokenize", {"tokens": out["tokens"]}) == {"prompt": "Héllo"}
    status, text, _ = _get(server + "/detokenize", {"tokens": [1, 999]})
    assert status == 400 and "token id 999 is outside" in text
    info = json.loads(_get(server + "/tokenizer_info")[1])
    assert info["model_max_length"] == MAX_LEN and "chat_template" in info


def test_an_api_key_is_required_but_health_and_metrics_are_open(server):
    status, text, headers = _get(server + "/v1/models", key="wrong")
    assert status == 401 and json.loads(text)["error"]["code"] == "invalid_api_key"
    assert headers["WWW-Authenticate"] == "Bearer"
    assert _get(server + "/v1/models", key=None)[0] == 401
    assert _get(server + "/health", key=None)[0] == 200
    assert _get(server + "/metrics", key=None)[0] == 200
    assert _metric(server, 'axplug_serve_rejected_requests_total{status="401"}') >= 2


def test_unknown_fields_are_ignored_and_logged_once(server, client):
    for _ in range(2):
        out = client.completions.create(
            model="tiny", prompt="hi", max_tokens=2, extra_body={"tempreature": 0.5}
        )
        assert out.usage.completion_tokens == 2
    log = _LOGS[server].read_text()
    assert log.count("ignoring the unknown request field 'tempreature'") == 1, log


_BAD_VALUES = [2**31, 2**63, -(2**63), -1, 1e308, "x" * 300, [], {}, True, [[-1]], {"a": []}]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_no_field_value_breaks_the_server(server, path):
    """Every field of the request schema, given each hostile value: a documented status, never
    a 5xx, and the engine serves the next request."""
    schema = json.loads(_get(server + "/openapi.json")[1])
    operation = schema["paths"][path]["post"]
    documented = {int(s) for s in operation["responses"]}
    assert 422 not in documented and {400, 401, 413, 429, 500, 503} <= documented
    name = "CompletionRequest" if "chat" not in path else "ChatCompletionRequest"
    good = {"model": "tiny", "max_tokens": 2}
    message = {"role": "user", "content": "hi"}
    good |= {"prompt": "hi"} if "chat" not in path else {"messages": [message]}
    seen = set()
    for field in schema["components"]["schemas"][name]["properties"]:
        for value in _BAD_VALUES:
            status, text, _ = _get(server + path, {**good, field: value})
            assert status in documented and status < 500, (field, value, text)
            seen.add(status)
    assert {200, 400} <= seen
    status, text, _ = _get(server + path, good)
    assert status == 200 and json.loads(text)["usage"]["completion_tokens"] == 2
    assert json.loads(_get(server + "/health")[1])["status"] == "ok"


def test_oversized_bodies_lone_surrogates_and_odd_methods(server):
    # json.dumps escapes the lone surrogate as \ud800, as a JavaScript client would send it.
    status, text, _ = _get(server + "/v1/completions", {"model": "tiny", "prompt": "a\ud800b"})
    assert status == 400 and "prompt (character 1): not valid Unicode" in text
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "\udfff"}]}
    status, text, _ = _get(server + "/v1/chat/completions", chat)
    assert status == 400 and "messages.0.content (character 0): not valid Unicode" in text
    status, text, _ = _get(server + "/v1/completions", b'{"prompt": "' + b"a" * MAX_BODY + b'"}')
    assert status == 413 and "at most 65536 bytes (--max-body-bytes)" in text
    status, text, headers = _get(server + "/v1/completions", method="TRACE")
    assert status == 405 and headers["Allow"] == "POST"
    status, _, headers = _get(server + "/v1/models", method="OPTIONS")
    assert status == 405 and headers["Allow"] == "GET"


# ------------------------------------------------------------------- text, in process


class _Bytes:
    def encode(self, text):
        return list(text.encode())

    def decode(self, ids):
        return bytes(ids).decode("utf-8", "replace")


def test_text_stream_holds_back_partial_characters_and_stop_prefixes():
    stream = TextStream(_Bytes(), list(b"> "), stop=["END"])
    out = [stream.push(t) for t in "é ok EN".encode()]
    assert out[0] == "" and out[1] == "é"  # the first byte of é alone is not text yet
    assert "".join(out) == "é ok "  # "EN" might begin "END": held
    assert stream.push(ord("D")) == "" and stream.stopped and stream.text == "é ok "
    free = TextStream(_Bytes(), [], stop=["END"])
    assert "".join(free.push(t) for t in b"EN!") == "EN!"  # not a stop after all
    assert free.flush() == ""


def test_chat_templates_come_from_the_tokenizer_and_run_sandboxed(tmp_path):
    tok = _Bytes()
    assert ChatTemplate.for_tokenizer(tok).render([{"role": "user", "content": "hi"}]) == (
        "user: hi\n\nassistant:"
    )
    (tmp_path / "tokenizer.json").write_text("{}")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": {"content": "<s>"},
        "chat_template": "{{ bos_token }}{% for m in messages %}[{{ m.role }}]{{ m.content }}"
                         "{% endfor %}{% if add_generation_prompt %}[assistant]{% endif %}",
    }))  # fmt: skip
    tok.source = tmp_path / "tokenizer.json"
    template = ChatTemplate.for_tokenizer(tok)
    assert template.render([{"role": "user", "content": "hi"}]) == "<s>[user]hi[assistant]"
    strict = ChatTemplate("{{ raise_exception('system messages are not supported') }}")
    with pytest.raises(ValueError, match="refused them: system messages are not supported"):
        strict.render([])
    escape = ChatTemplate("{{ messages.__class__.__mro__[1].__subclasses__() }}")
    with pytest.raises(ValueError):  # the sandbox never reaches Python's classes
        escape.render([])


def test_a_looping_chat_template_is_a_400_within_its_budget_and_frees_the_worker(
    run_dir, tmp_path, monkeypatch
):
    import time

    import axplug_chat.template
    import httpx
    from axplug_serve.testing import serve_in_thread

    monkeypatch.setattr(axplug_chat.template, "RENDER_SECONDS", 0.5)
    loop = tmp_path / "loop.jinja"  # 10**10 iterations: until the budget stops it
    loop.write_text("{% for i in range(99999) %}{% for j in range(99999) %}{% endfor %}"
                    "{% endfor %}{% for m in messages %}{{ m.content }}{% endfor %}")  # fmt: skip
    # No warm-up: the template is refused before the engine, and one short completion follows.
    argv = _serve_argv(run_dir, "--chat-template", str(loop), "--no-warmup")[1:]
    with serve_in_thread(argv, tmp_path / "server.log") as base:
        body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 2}  # fmt: skip
        headers = {"Authorization": f"Bearer {KEY}"}
        start = time.monotonic()
        answer = httpx.post(f"{base}/v1/chat/completions", json=body, headers=headers,
                            timeout=60)  # fmt: skip
        assert answer.status_code == 400, answer.text
        assert "rendering took over 0.5 s" in answer.json()["error"]["message"]
        assert time.monotonic() - start < 10
        # The server still answers (a one-token prompt: the programs of the `server` fixture's
        # warm-up, from the session's compilation cache).
        plain = {"model": "tiny", "prompt": "h", "max_tokens": 2}
        assert httpx.post(f"{base}/v1/completions", json=plain, headers=headers,
                          timeout=60).status_code == 200  # fmt: skip
