"""docs/chat-fine-tuning.md, followed as written: import, chat data, LoRA SFT, preference data,
DPO, merged and PEFT exports, generate."""

import json

import numpy as np
import pytest

from axplug.cli import main
from doc_pages import shell_commands
from test_docs_fine_tuning import small_llama
from test_hf_import import hf_weights, word_tokenizer, write_hf

# A template in the word tokenizer's own tokens, so that every rendered token is a word.
TEMPLATE = (
    "{% for m in messages %}<s> {{ m.content }} </s> {% endfor %}"
    "{% if add_generation_prompt %}<s> {% endif %}"
)


def test_the_page_runs_as_written(tmp_path, monkeypatch, capsys):
    pytest.importorskip("tokenizers")
    pytest.importorskip("axplug_lora")
    pytest.importorskip("axplug_dpo")
    cfg = small_llama()
    write_hf(tmp_path / "model", cfg, hf_weights(cfg))
    words = word_tokenizer(tmp_path / "model", cfg["vocab_size"])
    config = json.loads((tmp_path / "model" / "tokenizer_config.json").read_text())
    (tmp_path / "model" / "tokenizer_config.json").write_text(
        json.dumps({**config, "chat_template": TEMPLATE})
    )
    rng = np.random.default_rng(0)

    def say(n):
        return " ".join(rng.choice(words[3:-2], size=n))

    def chat():
        return [{"role": "user", "content": say(5)}, {"role": "assistant", "content": say(6)}]

    chats = [{"messages": chat()} for _ in range(40)]
    prefs = [{"prompt": say(4), "chosen": say(3), "rejected": say(3)} for _ in range(40)]
    for name, rows in (("chats.jsonl", chats), ("prefs.jsonl", prefs)):
        (tmp_path / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
    monkeypatch.chdir(tmp_path)
    steps = shell_commands("chat-fine-tuning.md")
    assert [argv[1] for argv in steps] == [
        "import-hf", "prepare-chat", "train", "prepare-preferences", "dpo-reference", "train",
        "export-hf", "export-lora", "generate",
    ]  # fmt: skip
    for argv in steps:
        assert main(argv[1:]) == 0, argv
    out = capsys.readouterr().out
    assert out.count("done: step 6") == 2
    meta = json.loads((tmp_path / "data" / "chat" / "meta.json").read_text())
    assert meta["chat_template"]["origin"].endswith("tokenizer_config.json")
    metrics = [json.loads(line) for line in (tmp_path / "runs" / "dpo" / "metrics.jsonl")
               .read_text().splitlines()]  # fmt: skip
    assert any("dpo/reward_margin" in m for m in metrics)
    adapter = json.loads((tmp_path / "adapters" / "sft" / "adapter_config.json").read_text())
    assert adapter["r"] == 8 and adapter["lora_alpha"] == 16
    assert (tmp_path / "hf" / "chat" / "model.safetensors").is_file()
    # `serve` renders chats with the template the run's data was prepared with.
    from axplug_chat import trained_template

    from axplug.inference import load_checkpoint

    found = trained_template(load_checkpoint("runs/dpo"))
    assert found == "data/prefs/chat_template.jinja"
    assert (tmp_path / found).read_text() == TEMPLATE
