"""The `hf` and `hf-disk` data sources, offline: the same shards and token ids as the core's
own readers for the same files, lazy reading, saved datasets, and one clear error each."""

from __future__ import annotations

import json
import os

import pytest
from axplug_hf_datasets import parse_disk_spec, parse_hub_spec
from axplug_testing import cli_main as main

from axplug.api import registry
from axplug.api.config import ConfigDependencyError, ConfigError, ConfigFileError
from axplug.api.data import open_shards, prepare_data, read_documents, source_kind

datasets = pytest.importorskip("datasets")


def test_the_tests_are_offline():
    """conftest.py sets HF_DATASETS_OFFLINE / HF_HUB_OFFLINE before `datasets` is imported."""
    assert datasets.config.HF_DATASETS_OFFLINE and datasets.config.HF_HUB_OFFLINE


ROWS = [
    {"text": f"document {i}: {'é' * (i % 3)} {'word ' * (i % 7)}".strip(), "id": i}
    for i in range(40)
] + [{"text": "", "id": 40}, {"text": 'quote " and, comma', "id": 41}]


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), "utf-8")
    return path


def prepared(tmp_path, name, sources, **options):
    """(meta.json's shards, each shard's token ids and document offsets) of `sources`."""
    out = tmp_path / name
    options = {"docs_per_shard": 7, "workers": 1, **options}
    meta = prepare_data([str(s) for s in sources], tokenizer="bytes", output=out, **options)
    shards = open_shards(out, meta)
    return meta["shards"], [(s.tokens.tolist(), s.docs.tolist()) for s in shards]


@pytest.mark.parametrize("workers", [1, 2])
def test_json_loader_gives_the_cores_jsonl_shards(tmp_path, workers):
    source = write_jsonl(tmp_path / "a.jsonl", ROWS)
    core = prepared(tmp_path, "core", [source], workers=workers)
    plugin = prepared(tmp_path, "hf", [f"hf:json:{source}"], workers=workers)
    assert plugin == core
    assert len(core[0]) == 6 and sum(r["documents"] for r in core[0]) == len(ROWS)
    assert core[1][0][0][: len("document 0")] == list(b"document 0")


def test_a_glob_and_a_list_are_read_in_order(tmp_path):
    (tmp_path / "d").mkdir()
    parts = [write_jsonl(tmp_path / "d" / f"part-{i}.jsonl", ROWS[i::3]) for i in range(3)]
    core = prepared(tmp_path, "core", parts)
    assert prepared(tmp_path, "glob", [f"hf:json:{tmp_path}/d/part-*.jsonl"]) == core
    listed = ",".join(str(p) for p in reversed(parts))
    assert list(read_documents(f"hf:jsonl:{listed}")) == [
        r["text"] for p in reversed(range(3)) for r in ROWS[p::3]
    ]


def test_parquet_loader_gives_the_cores_parquet_shards(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    texts = [r["text"] for r in ROWS]
    texts[3] = None  # no document, for both readers
    table = pa.table({"id": [r["id"] for r in ROWS], "content": texts})
    pq.write_table(table, tmp_path / "a.parquet", row_group_size=10)
    source = tmp_path / "a.parquet"
    core = prepared(tmp_path, "core", [source], field="content")
    assert prepared(tmp_path, "hf", [f"hf:parquet:{source}"], field="content") == core
    assert sum(r["documents"] for r in core[0]) == len(ROWS) - 1


def test_text_loader_gives_the_cores_lines(tmp_path):
    source = tmp_path / "a.txt"
    source.write_text("first line\n\nsecond, é\n   \nthird\nlast\n", encoding="utf-8")
    core = prepared(tmp_path, "core", [source], text_unit="line", docs_per_shard=2)
    assert prepared(tmp_path, "hf", [f"hf:text:{source}"], docs_per_shard=2) == core
    assert list(read_documents(f"hf:text:{source}")) == ["first line", "second, é", "third", "last"]


def test_csv_loader_gives_the_shards_of_the_same_rows_in_jsonl(tmp_path):
    import csv

    with open(tmp_path / "a.csv", "w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, ["id", "text"])
        writer.writeheader()
        writer.writerows(r for r in ROWS if r["text"])  # pandas reads an empty cell as null
    rows = [r for r in ROWS if r["text"]]
    core = prepared(tmp_path, "core", [write_jsonl(tmp_path / "a.jsonl", rows)])
    assert prepared(tmp_path, "hf", [f"hf:csv:{tmp_path / 'a.csv'}"]) == core


def test_whole_records_for_an_encoder(tmp_path):
    source = write_jsonl(tmp_path / "a.jsonl", ROWS[:5])
    assert list(read_documents(f"hf:json:{source}", field="*")) == ROWS[:5]
    assert list(read_documents(source, field="*")) == ROWS[:5]


def test_documents_are_read_lazily_past_a_corrupt_file(tmp_path, caplog):
    """The first documents come before the corrupt second file is read; reading it is one
    ConfigError, and prepare-data removes the output it created."""
    (tmp_path / "d").mkdir()
    write_jsonl(tmp_path / "d" / "part-0.jsonl", ROWS[:10])
    (tmp_path / "d" / "part-1.jsonl").write_text('{"text": "fine"}\n{"text": trunc\n')
    spec = f"hf:json:{tmp_path}/d/part-*.jsonl"
    documents = read_documents(spec)  # checked: files there, loader known; nothing read
    assert next(documents) == ROWS[0]["text"]
    again = read_documents(spec)
    assert [next(again) for _ in range(10)] == [r["text"] for r in ROWS[:10]]
    with pytest.raises(ConfigError, match=r"hf:json:.*unreadable after 10 records"):
        list(documents)
    with pytest.raises(ConfigError, match="unreadable after 10 records"):
        prepared(tmp_path, "out", [spec], docs_per_shard=5)
    assert not (tmp_path / "out").exists()


def test_streaming_takes_records_as_they_are_asked_for(tmp_path, monkeypatch):
    """The iterator pulls records from the dataset one by one, as documents are taken."""
    source = write_jsonl(tmp_path / "a.jsonl", ROWS)
    pulled = []
    real = datasets.IterableDataset.__iter__

    def counting(self):
        for record in real(self):
            pulled.append(record["id"])
            yield record

    monkeypatch.setattr(datasets.IterableDataset, "__iter__", counting)
    documents = read_documents(f"hf:json:{source}")
    assert pulled == []  # checked, not read
    assert [next(documents) for _ in range(3)] == [r["text"] for r in ROWS[:3]]
    assert pulled == [0, 1, 2]


def test_a_saved_dataset_directory_is_read_through_the_plugin(tmp_path):
    rows = [r for r in ROWS if r["text"]]
    dataset = datasets.Dataset.from_list(rows)
    dataset.save_to_disk(str(tmp_path / "saved"))
    core = prepared(tmp_path, "core", [write_jsonl(tmp_path / "a.jsonl", rows)])
    assert prepared(tmp_path, "dir", [tmp_path / "saved"]) == core  # the core's directory
    assert prepared(tmp_path, "disk", [f"hf-disk:{tmp_path / 'saved'}"]) == core
    assert prepared(tmp_path, "hf", [f"hf:{tmp_path / 'saved'}"]) == core
    assert list(read_documents(tmp_path / "saved", field="*"))[:2] == rows[:2]

    splits = datasets.DatasetDict(
        test=datasets.Dataset.from_dict({"text": ["t1", "t2"]}),
        validation=datasets.Dataset.from_dict({"text": ["v1"]}),
    )
    splits.save_to_disk(str(tmp_path / "dict"))
    assert list(read_documents(tmp_path / "dict")) == ["t1", "t2"]  # no train: the first
    assert list(read_documents(f"hf-disk:{tmp_path / 'dict'}:validation")) == ["v1"]
    with pytest.raises(ConfigError, match=r"no split 'train'; splits: \['test', 'validation'\]"):
        read_documents(f"hf:{tmp_path / 'dict'}::train")


def test_spec_grammar():
    here = os.path.abspath(__file__)
    assert parse_hub_spec("owner/name") == ("owner/name", None, None, None)
    assert parse_hub_spec("wikitext:wikitext-2-raw-v1:validation") == (
        "wikitext",
        "wikitext-2-raw-v1",
        "validation",
        None,
    )
    assert parse_hub_spec("imdb::test") == ("imdb", None, "test", None)
    assert parse_hub_spec(f"jsonl:{here}") == ("json", None, None, [here])
    assert parse_disk_spec(f"{os.path.dirname(here)}:test") == (os.path.dirname(here), "test")
    with pytest.raises(ConfigError, match="not a split name"):
        parse_hub_spec("imdb::train+test")
    with pytest.raises(ConfigError, match="too many ':' parts"):
        parse_hub_spec("a:b:c:d")
    with pytest.raises(ConfigError, match="name the data files"):
        parse_hub_spec("json")


def test_sources_that_stay_paths():
    assert source_kind("hf:json:x.jsonl") == ("hf", "json:x.jsonl")
    assert source_kind("hf-disk:x") == ("hf-disk", "x")
    for path in ("C:\\data\\a.jsonl", "c:\\data\\a.jsonl", "s3://bucket/a.jsonl",
                 "notes:2024.txt", "data/a.jsonl", "HF:x"):  # fmt: skip
        assert source_kind(path) is None, path
    with pytest.raises(ConfigFileError, match="does not exist") as info:
        read_documents("s3://bucket/a.jsonl")
    assert "data source" not in str(info.value)
    with pytest.raises(ConfigFileError, match=r"nor a data source NAME:SPEC"):
        read_documents("hff:a.jsonl")


def test_a_missing_column_names_the_columns(tmp_path):
    source = write_jsonl(tmp_path / "a.jsonl", ROWS[:3])
    with pytest.raises(ConfigError, match=r"no column 'body'; columns: \['text', 'id'\]"):
        next(read_documents(f"hf:json:{source}", field="body"))  # at the call, or first record
    from axplug_hf_datasets.sources import _documents  # where the features are unknown

    rows = _documents(iter([{"text": "a"}, {"body": "b"}]), "text", "hf:x")
    assert next(rows) == "a"
    with pytest.raises(ConfigError, match=r"hf:x: record 2: no column 'text'; columns: \['body'\]"):
        next(rows)
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"content": ["a"], "id": [1]}), tmp_path / "a.parquet")
    with pytest.raises(ConfigError, match=r"no column 'text'; columns: \['content', 'id'\]"):
        read_documents(f"hf:parquet:{tmp_path / 'a.parquet'}")  # known now: before writing
    datasets.Dataset.from_dict({"content": ["a"]}).save_to_disk(str(tmp_path / "saved"))
    with pytest.raises(ConfigError, match=r"no column 'text'; columns: \['content'\]"):
        prepare_data([tmp_path / "saved"], tokenizer="bytes", output=tmp_path / "out")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("spec", "error", "message"),
    [
        ("hf:json:{tmp}/missing.jsonl", ConfigFileError, "no file '.*missing.jsonl'"),
        ("hf:json:{tmp}/*.nothing", ConfigFileError, r"no file matches '.*\*.nothing'"),
        ("hf:json:{tmp}/a.jsonl:train", ConfigFileError, "takes no split"),
        ("hf:json:{tmp}", ConfigFileError, "is a directory: name its files"),
        ("hf:jsonn:{tmp}/a.jsonl", ConfigError, "unknown loader 'jsonn' .did you mean 'json'"),
        ("hf:{tmp}/nothing", ConfigFileError, "no directory '.*nothing'"),
        ("hf:{tmp}/a.jsonl", ConfigError, "is a file: read data files as hf:jsonl:"),
        ("hf-disk:{tmp}/nothing", ConfigFileError, "no directory"),
        ("hf-disk:{tmp}", ConfigFileError, "not a dataset saved by save_to_disk"),
        ("{tmp}", ConfigFileError, "not a dataset saved by save_to_disk"),
        ("hf:someone/nothing", ConfigError, "hf:someone/nothing: .*Hub.*OfflineModeIsEnabled"),
    ],
)
def test_a_bad_source_is_one_error_before_anything_is_written(tmp_path, spec, error, message):
    write_jsonl(tmp_path / "a.jsonl", ROWS[:2])
    spec = spec.format(tmp=tmp_path)
    with pytest.raises(error, match=message):
        prepare_data([spec], tokenizer="bytes", output=tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_the_cli_reads_hf_sources(tmp_path, capsys):
    source = write_jsonl(tmp_path / "a.jsonl", ROWS)
    argv = ["prepare-data", f"hf:json:{source}", "--tokenizer", "bytes", "--workers", "1"]
    assert main([*argv, "--output", str(tmp_path / "out")]) == 0
    meta = json.loads((tmp_path / "out" / "meta.json").read_text())
    assert meta["num_documents"] == len(ROWS)
    argv[1] = f"hf:json:{tmp_path}/nothing.jsonl"
    assert main([*argv, "--output", str(tmp_path / "bad")]) != 0
    lines = [x for x in capsys.readouterr().err.splitlines() if x.startswith("error:")]
    assert len(lines) == 1 and "no file" in lines[0], lines
    assert not (tmp_path / "bad").exists()


def test_without_the_plugin_a_source_points_to_the_docs(tmp_path, monkeypatch):
    """As if axplug-hf-datasets were not installed: the registry knows no data source, so
    `hf:...` is a path that does not exist, and a directory has no reader."""
    monkeypatch.setattr("axplug.registry.discover", lambda kind=None: [])  # the core's
    for source in ("hf:json:a.jsonl", "hf-disk:saved"):
        with pytest.raises(ConfigFileError, match="nor a data source NAME:SPEC; docs/your-data"):
            read_documents(source)
        assert source_kind(source) is None
    with pytest.raises(ConfigDependencyError, match="a directory, and no installed data source"):
        read_documents(tmp_path)
    with pytest.raises(ConfigFileError, match="does not exist"):
        read_documents("mysource:a.jsonl")  # neither registered nor known: a path


def test_a_disabled_plugin_says_so(monkeypatch):
    monkeypatch.setenv(registry.DISABLE_ENV, "axplug-hf-datasets")
    registry.reset()
    try:
        with pytest.raises(ConfigDependencyError, match="disabled"):
            read_documents("hf:json:a.jsonl")
    finally:
        monkeypatch.delenv(registry.DISABLE_ENV)
        registry.reset()


def test_the_group_is_registered_and_checked():
    from axplug.api.registry import check_kind

    assert "data_sources" in registry.KINDS
    found = {c.name: c for c in registry.discover("data_sources")}
    assert {"hf", "hf-disk"} <= set(found) and found["hf"].status == "ok"
    assert callable(registry.load("data_sources", "hf"))
    assert check_kind("data_sources", len) is None
    assert "documents(spec: str, *, field: str)" in check_kind("data_sources", dict)
    assert "documents(spec: str, *, field: str)" in check_kind("data_sources", "text")
