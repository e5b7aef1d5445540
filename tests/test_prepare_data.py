"""`axplug prepare-data`: sources to token shards, equal to tokenizing by hand; resumable."""

import json

import numpy as np
import pytest

from axplug.cli import main
from axplug.config import ConfigError
from axplug.input.prepare import prepare_data
from axplug.input.token_file import TokenFileInput
from axplug.tokenizer import load_tokenizer
from tokenizer_files import SAMPLE, hf_bpe

PARAGRAPHS = [p for p in SAMPLE[:40_000].split("\n\n") if p.strip()]


@pytest.fixture
def tokenizer(tmp_path):
    pytest.importorskip("tokenizers")
    return hf_bpe(tmp_path / "tok")


def stream(data_dir) -> list[int]:
    meta = json.loads((data_dir / "meta.json").read_text())
    return [
        int(t)
        for shard in meta["shards"]
        for t in np.fromfile(data_dir / f"{shard['name']}.bin", dtype=meta["dtype"])
    ]


def by_hand(tokenizer_path, documents) -> list[int]:
    tok = load_tokenizer(tokenizer_path)
    return [t for doc in documents for t in [*tok.encode(doc), tok.eos_id]]


def test_text_jsonl_and_parquet_give_the_hand_tokenized_stream(tmp_path, tokenizer):
    pyarrow = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    half = len(PARAGRAPHS) // 2
    text = tmp_path / "a.txt"
    text.write_text("\n\n".join(PARAGRAPHS[:half]), encoding="utf-8")
    jsonl = tmp_path / "b.jsonl"
    jsonl.write_text("".join(json.dumps({"body": p, "id": i}) + "\n"
                             for i, p in enumerate(PARAGRAPHS[half:])))  # fmt: skip
    parquet = tmp_path / "c.parquet"
    pq.write_table(pyarrow.table({"body": PARAGRAPHS[:7]}), parquet, row_group_size=3)
    out = tmp_path / "data"
    meta = prepare_data(
        [text, jsonl, parquet], tokenizer=tokenizer, output=out, field="body",
        text_unit="paragraph", docs_per_shard=25, workers=2,
    )  # fmt: skip
    documents = PARAGRAPHS[:half] + PARAGRAPHS[half:] + PARAGRAPHS[:7]
    assert stream(out) == by_hand(tokenizer, documents)
    assert meta["num_documents"] == len(documents) and meta["dtype"] == "uint16"
    assert meta["vocab_size"] == 400 and meta["eos_id"] == 2
    assert len(meta["shards"]) == -(-len(documents) // 25)
    assert (out / "tokenizer.json").read_bytes() == tokenizer.read_bytes()
    inp = TokenFileInput.default_config().set(path=str(out), seq_len=32, batch_size=2)
    assert inp.instantiate().batch(0)["input_ids"].shape == (2, 32)


def test_a_killed_run_resumes_to_the_same_output(tmp_path, tokenizer):
    src = tmp_path / "a.txt"
    src.write_text("\n\n".join(PARAGRAPHS), encoding="utf-8")
    args = dict(tokenizer=tokenizer, text_unit="paragraph", docs_per_shard=10, workers=1)
    clean = tmp_path / "clean"
    prepare_data([src], output=clean, **args)

    killed = tmp_path / "killed"
    seen = []

    def die_after_three(record):
        seen.append(record["name"])
        if len(seen) == 3:
            raise KeyboardInterrupt  # as a Ctrl-C or kill would, mid-run

    with pytest.raises(KeyboardInterrupt):
        prepare_data([src], output=killed, on_shard=die_after_three, **args)
    assert not (killed / "meta.json").exists()
    written = sorted(p.name for p in killed.glob("shard_*.bin"))
    assert written == ["shard_00000.bin", "shard_00001.bin", "shard_00002.bin"]
    redone = []
    prepare_data([src], output=killed, on_shard=lambda r: redone.append(r["bytes"]), **args)
    assert redone[:3] == [0, 0, 0] and all(b > 0 for b in redone[3:])  # only the rest retokenized
    for path in clean.iterdir():
        if path.name != "meta.json":
            assert (killed / path.name).read_bytes() == path.read_bytes(), path.name
    assert json.loads((killed / "meta.json").read_text()) == json.loads(
        (clean / "meta.json").read_text()
    )
    with pytest.raises(ConfigError, match="holds a preparation with other inputs or settings"):
        prepare_data([src], output=killed, **{**args, "docs_per_shard": 7})


def test_cli_prints_a_summary_and_one_line_errors(tmp_path, tokenizer, capsys):
    src = tmp_path / "a.jsonl"
    src.write_text("".join(json.dumps({"text": p}) + "\n" for p in PARAGRAPHS[:30]))
    out = tmp_path / "data"
    argv = ["prepare-data", str(src), "--tokenizer", str(tokenizer), "--output", str(out)]
    assert main(argv) == 0
    assert f"wrote {out}: 30 documents" in capsys.readouterr().out
    assert main([*argv[:2], str(tmp_path / "missing.txt"), *argv[2:]]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: prepare-data: ") and "missing.txt" in err[-1]
    assert main(["prepare-data", str(src), "--field", "body", "--tokenizer", str(tokenizer),
                 "--output", str(tmp_path / "d2")]) == 2  # fmt: skip
    assert "no field 'body' (use --field NAME)" in capsys.readouterr().err
