"""docs/your-data.md, followed as written: its shell blocks run in order in a fresh directory."""

import os
import shutil

import pytest

from axplug.cli import main
from doc_pages import shell_commands


def test_the_page_runs_as_written(tmp_path, monkeypatch, capsys):
    pytest.importorskip("tokenizers")
    from axplug.input import bundled_corpus_path
    from tokenizer_files import hf_bpe

    shutil.copyfile(bundled_corpus_path(), tmp_path / "corpus.txt")
    hf_bpe(tmp_path / "tok")
    shutil.copyfile(tmp_path / "tok" / "tokenizer.json", tmp_path / "tokenizer.json")
    monkeypatch.chdir(tmp_path)
    steps = shell_commands("your-data.md", before="## Data at scale")
    assert [argv[:2] for argv in steps] == [
        ["axplug", "prepare-data"],
        ["axplug", "data"],
        ["axplug", "train"],
        ["axplug", "generate"],
    ]
    for argv in steps:
        assert main(argv[1:]) == 0, argv
    out = capsys.readouterr().out
    assert "wrote data/corpus:" in out and "done: step 10" in out
    assert "data/corpus: ok, 4 shard(s), 3,595 documents" in out
    assert "\nHAMLET." in out.split("done: step 10")[1]  # the generated text, from the prompt
    metrics = (tmp_path / "runs" / "corpus" / "metrics.jsonl").read_text()
    assert '"eval_loss"' in metrics  # eval_every ran on the held-out documents
    assert os.path.isfile(tmp_path / "data" / "corpus" / "tokenizer.json")
