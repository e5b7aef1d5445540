"""docs/fine-tuning.md, followed as written: import, tokenize, fine-tune, generate."""

import json

import numpy as np
import pytest

from axplug.cli import main
from doc_pages import shell_commands
from test_hf_import import hf_weights, llama_config, word_tokenizer, write_hf


def small_llama() -> dict:
    """The pages' small LLaMA. No dimension is a multiple of the 8 devices: orbax then saves
    each replicated array whole, not a slice per device (a program to compile per slice)."""
    sizes = {"hidden_size": 36, "intermediate_size": 50, "vocab_size": 90}
    return llama_config(**sizes, num_attention_heads=2, num_key_value_heads=1)


def test_the_page_runs_as_written(tmp_path, monkeypatch, capsys):
    pytest.importorskip("tokenizers")
    cfg = small_llama()
    write_hf(tmp_path / "model", cfg, hf_weights(cfg))
    words = word_tokenizer(tmp_path / "model", cfg["vocab_size"])
    rng = np.random.default_rng(0)
    lines = [" ".join(rng.choice(words[3:], size=rng.integers(5, 30))) for _ in range(200)]
    (tmp_path / "notes.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in lines))
    monkeypatch.chdir(tmp_path)
    steps = shell_commands("fine-tuning.md")
    assert [argv[1] for argv in steps] == [
        "import-hf",
        "prepare-data",
        "train",
        "generate",
        "export-hf",
    ]
    for argv in steps:
        assert main(argv[1:]) == 0, argv
    out = capsys.readouterr().out
    assert "done: step 6" in out
    assert "\nto be" in out.split("done: step 6")[1]  # generated text, from the prompt
    record = json.loads((tmp_path / "runs" / "tuned" / "config.json").read_text())
    assert record["provenance"]["source"] == "--from runs/base"
    assert record["config"]["restore"]["init_from"] == "runs/base"
    exported = json.loads((tmp_path / "hf" / "tuned" / "config.json").read_text())
    assert exported["architectures"] == ["LlamaForCausalLM"] and exported["eos_token_id"] == 2
    assert (tmp_path / "hf" / "tuned" / "tokenizer.json").is_file()
