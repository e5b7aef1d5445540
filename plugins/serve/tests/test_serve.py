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

import pytest

pytest.importorskip("axplug_serve")
openai = pytest.importorskip("openai")

from axplug_serve.text import ChatTemplate, TextStream  # noqa: E402

from axplug.cli.main import main  # noqa: E402
from axplug.inference import SamplingParams, find_tokenizer, generate, load_checkpoint  # noqa: E402

MAX_LEN = 256


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    from axplug.testing import tiny_trainer_config
    from axplug.trainer.run import train

    out = str(tmp_path_factory.mktemp("served") / "tiny")
    train(tiny_trainer_config(out, "checkpoint_every=2", "input.seq_len=64", preset="llama-tiny"))
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


@contextlib.contextmanager
def _serve(run_dir, tmp_path_factory, *extra):
    """`axplug serve` in its own process (2 slots, 1 queued), stopped by its PID."""
    port = _free_port()
    log = tmp_path_factory.mktemp("serve-log") / "server.log"
    cmd = [sys.executable, "-m", "axplug.cli", "serve", "--checkpoint", run_dir,
           "--port", str(port), "--num-slots", "2", "--max-queue", "1",
           "--max-len", str(MAX_LEN), "--log-level", "warning", *extra]  # fmt: skip
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 240
        while True:
            try:
                if _get(base + "/health")[0] == 200:
                    break
            except OSError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"axplug serve did not start:\n{log.read_text()}")
            time.sleep(0.5)
        # The engine's gauges are there before any request (2 rows x 256 / 16 pages).
        paged = "--kv-cache" not in extra
        assert _metric(base, "axplug_serve_kv_pages_free") == (32 if paged else -1)
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
    with _serve(run_dir, tmp_path_factory) as base:
        yield base


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def reference(run_dir):
    """Greedy ids of the same checkpoint, decoded in this process by the core's Engine."""
    loaded = load_checkpoint(run_dir)
    tokenizer = find_tokenizer(loaded, run_dir)

    def greedy(prompt_ids: list[int], n: int) -> list[int]:
        sampling = SamplingParams(max_new_tokens=n, temperature=0)
        return generate(loaded.model, loaded.params, [prompt_ids], sampling)[0].output_ids

    return tokenizer, greedy


def _metric(base: str, name: str) -> float:
    text = _get(base + "/metrics")[1]
    values = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
              if line.startswith(name + " ") or line.startswith(name + "{")]  # fmt: skip
    return sum(values)


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
        ({"n": 2}, "n: only n=1 is supported"),
        ({"top_p": 0}, "top_p: Input should be greater than 0"),
        ({"extra_body": {"tempreature": 0.5}}, "tempreature: Extra inputs are not permitted"),
        ({"logprobs": 2}, "logprobs: not supported by this server"),
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
    request = urllib.request.Request(
        server + "/v1/completions", data=b'{"model": "tiny", "prompt": "hi",,}',
        headers={"Content-Type": "application/json"},
    )  # fmt: skip
    try:
        urllib.request.urlopen(request, timeout=10)
    except urllib.error.HTTPError as e:
        status, error = e.code, json.loads(e.read())["error"]
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
    # 2 slots + 1 queued: three long requests in flight, the fourth is refused.
    streams = [
        client.completions.create(model="tiny", prompt="To be", max_tokens=240, stream=True)
        for _ in range(3)
    ]
    with pytest.raises(openai.RateLimitError, match="at capacity"):
        client.completions.create(model="tiny", prompt="x", max_tokens=2)
    assert _metric(server, 'axplug_serve_rejected_requests_total{status="429"}') >= 1
    for stream in streams:
        stream.close()
    _wait_idle(server)
    out = client.completions.create(model="tiny", prompt="x", max_tokens=2)
    assert out.usage.completion_tokens == 2


def test_health_models_and_help(server, capsys):
    status, body = _get(server + "/health")
    assert status == 200 and json.loads(body)["status"] == "ok"
    assert re.search(r"^axplug_serve_time_to_first_token_seconds_count [1-9]", _get(
        server + "/metrics")[1], re.M)  # fmt: skip
    assert main(["--help"]) == 0
    assert re.search(r"serve\s+an OpenAI-compatible HTTP server", capsys.readouterr().out)
    assert main(["list", "--kind", "commands"]) == 0
    assert re.search(r"axplug-serve\s+\S+\s+commands\s+serve\s+ok", capsys.readouterr().out)


@pytest.mark.parametrize(
    "extra",
    [
        ["--prefill-devices", "4"],
        # Chunked prefill with either cache is covered in-process (test_inference.py).
        pytest.param(["--kv-cache", "contiguous", "--prefill-chunk", "4"], marks=pytest.mark.slow),
    ],
    ids=["disaggregated", "contiguous-chunked"],
)
def test_other_engines_serve_the_same_text(run_dir, tmp_path_factory, reference, extra):
    tokenizer, greedy = reference
    with _serve(run_dir, tmp_path_factory, *extra) as base:
        client = openai.OpenAI(base_url=base + "/v1", api_key="-", max_retries=0, timeout=120)
        prompt = "HAMLET. To be, or not to be"
        out = client.completions.create(model="tiny", prompt=prompt, max_tokens=16, temperature=0)
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
