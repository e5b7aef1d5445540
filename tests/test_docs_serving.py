"""docs/serving.md, followed as written: `axplug serve` on the demo's run, and each curl
command's reply checked against what the page says it is."""

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
    from axplug_testing import copy_run

    copy_run(trained_run("llama-tiny", "input.seq_len=64"), tmp_path / "runs" / "demo")
    monkeypatch.chdir(tmp_path)
    serve, *curls = shell_commands("serving.md")
    assert serve[:2] == ["axplug", "serve"] and serve[-4:-2] == ["--port", "8000"]
    checked = []
    # Without the warm-up: the page's four requests compile the widths they use, not all.
    options = [*serve[2:-4], *serve[-2:], "--no-warmup"]
    with serve_in_thread(options, tmp_path / "server.log") as base:
        for argv in curls:
            assert argv[0] == "curl", argv
            argv = [arg.replace("http://localhost:8000", base) for arg in argv]
            out = subprocess.run(argv, capture_output=True, text=True, timeout=300, check=True)
            reply, body = json.loads(out.stdout), json.loads(argv[argv.index("-d") + 1])
            assert body["model"] == "demo" and "choices" in reply, reply
            choice = reply["choices"][0]
            text = choice["message"]["content"] if "message" in choice else choice["text"]
            assert choice["finish_reason"] == ("tool_calls" if "tools" in body else "stop")
            if "response_format" in body:
                schema = body["response_format"]["json_schema"]["schema"]
                jsonschema.validate(json.loads(text), schema)
                checked.append("response_format")
            elif "tools" in body:
                (call,) = choice["message"]["tool_calls"]
                parameters = body["tools"][0]["function"]["parameters"]
                jsonschema.validate(json.loads(call["function"]["arguments"]), parameters)
                checked.append("tools")
                continue
            elif "guided_choice" in body:
                assert text in body["guided_choice"], text
                checked.append("guided_choice")
            else:
                assert re.fullmatch(body["guided_regex"], text), text
                checked.append("guided_regex")
    assert checked == ["response_format", "guided_choice", "guided_regex", "tools"]
