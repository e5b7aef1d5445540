"""docs/vision.md, followed as written on a tiny random LLaVA: import, describe an image,
prepare image chats, fine-tune with LoRA, generate, export, and the page's openai snippet
against `axplug serve`."""

import json
import pathlib
import re
import runpy
import shlex

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

from test_image_chat import PROCESSOR, _trained, byte_tokenizer, png, tiny_llava  # noqa: E402

PAGE = pathlib.Path(__file__).resolve().parents[3] / "docs" / "vision.md"


def blocks(kind: str, before: str | None = None) -> list[str]:
    """The page's ```KIND blocks, in order (before the heading `before`, when given)."""
    text = PAGE.read_text()
    text = text if before is None else text[: text.index(f"\n{before}\n")]
    return re.findall(rf"^```{kind}\n(.*?)^```", text, flags=re.S | re.M)


def test_the_page_runs_as_written(tmp_path, monkeypatch):
    from axplug_testing import run_cli

    reference, tok = tiny_llava(), byte_tokenizer()
    reference.save_pretrained(tmp_path / "models" / "llava")
    tok.save(str(tmp_path / "models" / "llava" / "tokenizer.json"))
    (tmp_path / "models" / "llava" / "preprocessor_config.json").write_text(json.dumps(PROCESSOR))
    (tmp_path / "photo.png").write_bytes(png(3, 24, 20))
    (chats,) = blocks("json")
    (tmp_path / "chats.jsonl").write_text(chats)
    monkeypatch.chdir(tmp_path)

    commands = [shlex.split(line) for b in blocks("sh", "## Planning") for line in b.splitlines()]
    assert [argv[1] for argv in commands] == [
        "import-hf", "generate", "prepare-chat", "train", "export-hf",
    ]  # fmt: skip
    out = ""
    for argv in commands:  # through run_cli: the `axplug` logger left as it was
        result = run_cli(*argv[1:])
        assert result.exit_code == 0, (argv, result.stderr)
        out += result.stdout
    assert out.count("What is in it? ASSISTANT:") == 1  # the generation, from the prompt
    exported = transformers.AutoModelForImageTextToText.from_pretrained(tmp_path / "hf" / "vl")
    assert type(exported).__name__ == "LlavaForConditionalGeneration"
    assert "done: step 4" in out
    # The fine-tune stores its adapters only, all on the language model.
    paths, _ = _trained(tmp_path / "runs" / "vl")
    assert paths and all(p.startswith("decoder/") for p in paths)
    assert all(p.endswith(("adapter/lora_a", "adapter/lora_b")) for p in paths)

    # The planning command is test_vision_presets. own (that test compiles it).
    (plan,) = [shlex.split(b.strip()) for b in blocks("sh")[-1:]]
    from test_vision_presets import AOT_ARGV

    assert plan[1:] == AOT_ARGV

    # The openai snippet, against the fine-tune served as the page says.
    pytest.importorskip("openai")
    from axplug_serve.testing import serve_in_thread

    (snippet,) = blocks("python")
    with serve_in_thread(["--checkpoint", "runs/vl", "--no-warmup"], tmp_path / "log") as base:
        script = tmp_path / "snippet.py"
        script.write_text(snippet.replace("http://localhost:8000/v1", f"{base}/v1"))
        reply = runpy.run_path(str(script))["reply"]  # as `python snippet.py`, in this process
    assert reply.choices[0].message.content and reply.usage.completion_tokens == 16
    # The image's 16 placeholders are prompt tokens, beside the rendered text's.
    text = "user: What is in it?"
    assert reply.usage.prompt_tokens >= 16 + len(text)
