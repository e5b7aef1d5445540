"""docs/serving.md, followed as written: `axplug train` and `axplug serve` on the demo's run,
and each curl command's reply checked against what the page says it is."""

import contextlib
import json
import re
import subprocess

import pytest

from doc_pages import shell_commands


def test_the_page_runs_as_written(tmp_path, monkeypatch, trained_run):
    pytest.importorskip("axplug_serve")
    pytest.importorskip("axplug_structured")
    jsonschema = pytest.importorskip("jsonschema")
    from axplug_serve.testing import serve_in_thread
    from axplug_testing import cli_main, copy_run

    copy_run(trained_run("llama-tiny", "input.seq_len=64"), tmp_path / "runs" / "demo")
    monkeypatch.chdir(tmp_path)
    checked, servers, base = [], contextlib.ExitStack(), None
    with servers:
        for argv in shell_commands("serving.md"):
            if argv[:2] == ["axplug", "train"]:
                assert cli_main([*argv[1:], "-q"]) == 0
                continue
            if argv[:2] == ["axplug", "serve"]:
                servers.close()
                at = argv.index("--port")
                assert argv[at + 1] == "8000"
                # Without the warm-up: the page's requests compile the widths they use only.
                options = [*argv[2:at], *argv[at + 2 :], "--no-warmup"]
                log = tmp_path / f"server{len(checked)}.log"
                base = servers.enter_context(serve_in_thread(options, log))
                continue
            assert argv[0] == "curl", argv
            argv = [arg.replace("http://localhost:8000", base) for arg in argv]
            out = subprocess.run(argv, capture_output=True, text=True, timeout=300, check=True)
            reply = json.loads(out.stdout)
            checked.append(_check(argv, reply, jsonschema))
    assert checked == ["response_format", "guided_choice", "guided_regex", "tools", "lora",
                       "load", "models", "unload", "quantized"]  # fmt: skip


def _check(argv: list[str], reply: dict, jsonschema) -> str:
    """What the page says of `reply` to the curl command `argv`; the section's name."""
    url = next(arg for arg in argv if arg.startswith("http"))
    if url.endswith("/v1/models"):
        cards = {card["id"]: card for card in reply["data"]}
        assert list(cards) == ["demo", "again", "lively"], reply
        assert cards["again"]["parent"] == "demo" and cards["again"]["root"] == "runs/demo-lively"
        return "models"
    body = json.loads(argv[argv.index("-d") + 1])
    if url.endswith("/v1/load_lora_adapter"):
        assert reply["id"] == "again" and reply["parent"] == "demo", reply
        return "load"
    if url.endswith("/v1/unload_lora_adapter"):
        assert reply == {"id": "again", "object": "model", "deleted": True}
        return "unload"
    assert reply["model"] == body["model"] and "choices" in reply, reply
    choice = reply["choices"][0]
    text = choice["message"]["content"] if "message" in choice else choice["text"]
    structured = ("response_format", "tools", "guided_choice", "guided_regex")
    if not any(field in body for field in structured):  # greedy text of the fine-tune, int8
        assert reply["usage"]["completion_tokens"] == body["max_tokens"], reply
        return "lora" if body["model"] == "lively" else "quantized"
    assert choice["finish_reason"] == ("tool_calls" if "tools" in body else "stop")
    if "response_format" in body:
        jsonschema.validate(json.loads(text), body["response_format"]["json_schema"]["schema"])
        return "response_format"
    if "tools" in body:
        (call,) = choice["message"]["tool_calls"]
        parameters = body["tools"][0]["function"]["parameters"]
        jsonschema.validate(json.loads(call["function"]["arguments"]), parameters)
        return "tools"
    if "guided_choice" in body:
        assert text in body["guided_choice"], text
        return "guided_choice"
    assert re.fullmatch(body["guided_regex"], text), text
    return "guided_regex"
