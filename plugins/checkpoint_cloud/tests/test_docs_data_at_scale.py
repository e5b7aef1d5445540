"""docs/your-data.md's "Data at scale", followed as written against moto on 127.0.0.1."""

import json
import shutil
from pathlib import Path

import pytest
from axplug_testing import cli_main as main

from object_stores import create_s3_bucket

_TESTS = str(Path(__file__).resolve().parents[3] / "tests")


def test_the_section_runs_as_written(tmp_path, monkeypatch, capsys, moto):
    pytest.importorskip("tokenizers")
    monkeypatch.syspath_prepend(_TESTS)
    from axplug.api.data import bundled_corpus_path
    from doc_pages import shell_commands
    from tokenizer_files import hf_bpe

    monkeypatch.setenv("AWS_ENDPOINT_URL", moto.url)
    create_s3_bucket(moto.url, "my-bucket")
    shutil.copyfile(bundled_corpus_path(), tmp_path / "corpus.txt")
    hf_bpe(tmp_path / "tok")
    shutil.copyfile(tmp_path / "tok" / "tokenizer.json", tmp_path / "tokenizer.json")
    monkeypatch.chdir(tmp_path)
    _array_record_documents(tmp_path / "tok", tmp_path / "data" / "docs.array_record")
    monkeypatch.setenv("AXPLUG_CACHE", str(tmp_path / "cache"))
    steps = shell_commands("your-data.md", "## Data at scale")
    assert [argv[:2] for argv in steps] == [
        ["axplug", "prepare-data"],
        ["axplug", "data"],
        ["axplug", "train"],
        ["axplug", "generate"],
        ["axplug", "train"],
        ["axplug", "prepare-data"],
        ["axplug", "prepare-data"],
        ["axplug", "prepare-data"],
        ["axplug", "launch"],
        ["axplug", "train"],
    ]
    for argv in steps:
        assert main(argv[1:]) == 0, argv
    out = capsys.readouterr().out
    assert "wrote s3://my-bucket/data/corpus:" in out
    assert "HAMLET." in out.split("done: step 4")[1]  # decoded by the bucket's tokenizer
    assert list((tmp_path / "cache" / "tokenizers").glob("*/tokenizer.json"))
    assert "s3://my-bucket/data/corpus: ok, 4 shard(s), 3,595 documents" in out
    assert "#SBATCH --array=0-63%16" in out and '--task-index "$SLURM_ARRAY_TASK_ID"' in out
    grain = json.loads((tmp_path / "runs/grain/checkpoints/step_00000004/metadata/metadata")
                       .read_text())  # fmt: skip
    assert grain["input_state"][0]["format"] == "axplug-grain-1"
    lines = json.loads((tmp_path / "data" / "lines" / "meta.json").read_text())
    text = (tmp_path / "corpus.txt").read_text()
    assert lines["num_documents"] == sum(1 for x in text.splitlines() if x.strip())
    assert (tmp_path / "data" / "split" / "meta.json").exists()  # the second task merged
    rows = [json.loads(line) for line in (tmp_path / "runs/mix/metrics.jsonl").open()]
    last = [r for r in rows if "data/tokens/split" in r][-1]
    assert last["step"] == 4 and last["data/share/split"] > last["data/share/bucket"]


def _array_record_documents(tokenizer, path):
    """The corpus's paragraphs, tokenized with EOS, as an ArrayRecord file for `grain`."""
    from axplug_grain import write_array_record

    from axplug.api.data import bundled_corpus_path, load_tokenizer

    tok = load_tokenizer(tokenizer)
    paragraphs = [p for p in bundled_corpus_path().read_text().split("\n\n") if p.strip()]
    path.parent.mkdir(parents=True, exist_ok=True)
    write_array_record(path, [[*tok.encode(p), tok.eos_id] for p in paragraphs[:600]])
