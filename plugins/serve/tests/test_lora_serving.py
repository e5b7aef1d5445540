"""`axplug serve --lora`: adapters chosen by the request's `model`, sharing batches with the
base, against engines over the merged models; loading and unloading while serving."""

from __future__ import annotations

import concurrent.futures
import json
import urllib.request

import numpy as np
import pytest

pytest.importorskip("axplug_serve")
pytest.importorskip("axplug_lora")
openai = pytest.importorskip("openai")

from axplug_testing import cli_main as main  # noqa: E402

from axplug.api.run import (  # noqa: E402
    Engine,
    Request,
    SamplingParams,
    find_tokenizer,
    load_checkpoint,
)

KEY = "admin-key"
LORAS = {"terse": "lora:rank=4,alpha=8,targets=['q','v']", "wordy": "lora:rank=8,alpha=8"}
PROMPTS = [[5, 6, 7, 8, 9], [72, 101, 108, 108, 111, 32, 119, 111, 114, 108, 100]]


def _lora_argv(base: str, out: str, modifier: str) -> list[str]:
    """Three LoRA steps over `base` at a high learning rate: adapters that change its text."""
    return ["train", "--from", base, "--output-dir", out, "--modifier", modifier,
            "--input", "synthetic:vocab_size=256", "--max-steps", "3", "-q",
            "--set", "learner.learning_rate=0.05", "--set", "learner.warmup_steps=0",
            "--set", "learner.schedule='constant'", "--set", "compilation_cache_dir=None",
            "--set", "input.seq_len=32", "--mesh-rule", "none", "--modifier", "mesh"]  # fmt: skip


@pytest.fixture(scope="module")
def runs(tmp_path_factory, trained_run):
    """The served base (llama-tiny, shared with other modules: read only) and two LoRA runs
    trained over it, by name."""
    base = str(trained_run("llama-tiny", "input.seq_len=64"))
    root = tmp_path_factory.mktemp("loras")
    loras = {}
    for name, modifier in LORAS.items():
        assert main(_lora_argv(base, str(root / name), modifier)) == 0
        loras[name] = str(root / name)
    return base, loras


@pytest.fixture(scope="module")
def server(runs, tmp_path_factory):
    from axplug_serve.testing import serve_in_thread

    base, loras = runs
    options = ["--checkpoint", base, "--model-name", "base", "--num-slots", "6",
               "--max-len", "64", "--prefill-chunk", "16", "--api-key", KEY, "--max-loras", "3",
               "--log-level", "warning", "--no-warmup",
               *(f"--lora={name}={run}" for name, run in loras.items())]  # fmt: skip
    with serve_in_thread(options, tmp_path_factory.mktemp("lora-log") / "server.log") as url:
        yield url


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key=KEY, max_retries=0, timeout=120)


def _post(url: str, body: dict, key: str | None = KEY) -> tuple[int, dict]:
    request = urllib.request.Request(url, json.dumps(body).encode(), method="POST")
    request.add_header("Content-Type", "application/json")
    if key:
        request.add_header("Authorization", f"Bearer {key}")
    try:
        with urllib.request.urlopen(request, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _complete(client, model: str, prompt: list[int]):
    reply = client.completions.create(model=model, prompt=prompt, max_tokens=8, temperature=0,
                                      logprobs=1)  # fmt: skip
    assert reply.model == model
    return reply.choices[0]


def _merged_greedy(runs: list[tuple[str, bool]]) -> list[dict[tuple, tuple[str, list[float]]]]:
    """For each (run, merge): (text, logprobs) of each prompt's greedy reply, by an Engine
    over the run (merged). The merged models have the base's structure: one Engine (one set of
    programs; no prefix cache, whose pages would hold another model's keys) takes each one's
    parameters in turn."""
    engine, out = None, []
    for run, merge in runs:
        loaded = load_checkpoint(run, modifiers=["paged_kv_cache:page_size=16"],
                                 merge_adapters=merge)  # fmt: skip
        if engine is None:
            engine = Engine(loaded.model, loaded.params, num_slots=2, max_len=64,
                            prefill_chunk=16, prefix_caching=False)  # fmt: skip
            tokenizer = find_tokenizer(loaded, run)
        engine.params = loaded.params
        for prompt in PROMPTS:
            greedy = SamplingParams(max_new_tokens=8, temperature=0, logprobs=0)
            engine.submit(Request(prompt, greedy, id=tuple(prompt)))
        out.append({c.id: (tokenizer.decode(c.output_ids), [e.logprob for e in c.output_logprobs])
                    for c in engine.run()})  # fmt: skip
    return out


def test_adapters_and_the_base_in_one_batch_equal_their_merged_models(server, client, runs):
    base, loras = runs
    models = ["base", *loras]
    assert [m.id for m in client.models.list().data] == models
    card = client.models.retrieve("terse")
    assert card.parent == "base" and card.root == loras["terse"]
    jobs = [(model, prompt) for prompt in PROMPTS for model in models]  # six rows at once
    with concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:
        replies = list(pool.map(lambda job: _complete(client, *job), jobs))
    texts = set()
    merged = _merged_greedy([(loras.get(model, base), model != "base") for model in models])
    for model, want in zip(models, merged, strict=True):
        for (asked, prompt), choice in zip(jobs, replies, strict=True):
            if asked != model:
                continue
            text, logprobs = want[tuple(prompt)]
            assert choice.text == text, (model, prompt)
            np.testing.assert_allclose(choice.logprobs.token_logprobs, logprobs, atol=1e-5)
            texts.add(choice.text)
    assert len(texts) == len(jobs)  # every adapter says something else


def test_adapters_load_and_unload_while_serving(server, client, runs):
    base, loras = runs
    load, unload = server + "/v1/load_lora_adapter", server + "/v1/unload_lora_adapter"
    want = _complete(client, "terse", PROMPTS[0]).text
    status, card = _post(load, {"lora_name": "again", "lora_path": loras["terse"]})
    assert status == 200 and card["id"] == "again" and card["parent"] == "base"
    assert _complete(client, "again", PROMPTS[0]).text == want
    status, error = _post(load, {"lora_name": "more", "lora_path": loras["wordy"]})
    assert status == 409 and "adapter slots" in error["error"]["message"]  # 3 slots, 3 held
    assert _post(load, {"lora_name": "terse", "lora_path": loras["wordy"]})[0] == 409
    status, error = _post(load, {"lora_name": "x", "lora_path": base})
    assert status == 400 and "no LoRA adapters" in error["error"]["message"]
    assert error["error"]["param"] == "lora_path"
    assert _post(load, {"lora_name": "x", "lora_path": base + "/nowhere"})[0] == 400
    assert _post(load, {"lora_name": "x", "lora_path": loras["terse"]}, key=None)[0] == 401
    assert _post(unload, {"lora_name": "again"}) == (200, {"id": "again", "object": "model",
                                                          "deleted": True})  # fmt: skip
    assert _post(unload, {"lora_name": "again"})[0] == 404
    with pytest.raises(openai.NotFoundError, match="'again' does not exist"):
        _complete(client, "again", PROMPTS[0])
    status, _ = _post(load, {"lora_name": "more", "lora_path": loras["wordy"]})  # the freed slot
    assert status == 200
    assert _complete(client, "more", PROMPTS[0]).text == _complete(client, "wordy", PROMPTS[0]).text
    assert [m.id for m in client.models.list().data] == ["base", "more", "terse", "wordy"]


def test_serve_refuses_adapters_of_another_base(runs, capsys):
    _, loras = runs
    # The served model is the `wordy` run (merged): `terse` was trained over its base, not it.
    argv = ["serve", "--checkpoint", loras["wordy"], "--lora", f"terse={loras['terse']}"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "was trained over step" in err and "not over" in err
    assert main(["serve", "--checkpoint", loras["wordy"], "--lora", "nameless"]) == 2
    assert "expected NAME=RUN" in capsys.readouterr().err


def test_runtime_loading_needs_an_api_key(runs):
    import argparse

    from axplug_serve import command
    from fastapi.testclient import TestClient

    parser = argparse.ArgumentParser(prog="axplug")
    command.add_parser(parser.add_subparsers())
    args = parser.parse_args(["serve", "--checkpoint", runs[0], "--max-loras", "1",
                              "--no-warmup", "--max-len", "64"])  # fmt: skip
    app, _, _ = command.build(args)
    body = {"lora_name": "x", "lora_path": runs[1]["terse"]}
    reply = TestClient(app).post("/v1/load_lora_adapter", json=body)
    assert reply.status_code == 403 and "--api-key" in reply.json()["error"]["message"]
