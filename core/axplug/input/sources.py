"""The documents of `prepare-data`'s sources: text, JSONL, Parquet or a saved Hugging Face
dataset, read in order; a record or line that cannot be read is named by file and line."""

from __future__ import annotations

import json
import os
import pathlib
from collections.abc import Iterator

from axplug.config import ConfigDependencyError, ConfigError, ConfigFileError

__all__ = ["read_documents", "chunks", "TEXT_UNITS", "RECORD"]

TEXT_UNITS = ("file", "paragraph", "line")
RECORD = "*"  # the field that means a JSONL line's whole object (a chat, a preference pair)


def _text_documents(path: pathlib.Path, unit: str) -> Iterator[str]:
    text = path.read_text(encoding="utf-8", errors="replace")
    if unit == "file":
        parts = [text]
    elif unit == "paragraph":
        parts = text.split("\n\n")
    else:
        parts = text.splitlines()
    yield from (p for p in parts if p.strip())


def _jsonl_documents(path: pathlib.Path, field: str) -> Iterator[str]:
    with open(path, "rb") as f:  # lines decoded one by one, so an error names its line
        for number, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8")
                record = json.loads(line) if line.strip() else None
            except (UnicodeDecodeError, json.JSONDecodeError) as e:
                raise ConfigError(
                    f"{path}:{number}: not a JSON line ({e}; a truncated line?): fix or remove it"
                ) from None
            if record is None:
                continue
            if not isinstance(record, dict):
                raise ConfigError(f"{path}:{number}: a {type(record).__name__}, not a JSON object")
            if field == RECORD:
                yield record
                continue
            if field not in record:
                raise ConfigError(f"{path}:{number}: no field {field!r} (use --field NAME)")
            yield str(record[field])


def _parquet_documents(path: pathlib.Path, field: str) -> Iterator[str]:
    import pyarrow.parquet as pq

    table = pq.ParquetFile(path)
    if field not in table.schema_arrow.names:
        raise ConfigError(f"{path}: no column {field!r}; columns: {table.schema_arrow.names}")
    for batch in table.iter_batches(columns=[field]):
        yield from (str(v) for v in batch.column(0).to_pylist() if v is not None)


def _dataset_documents(path: pathlib.Path, field: str) -> Iterator[str]:
    import datasets

    dataset = datasets.load_from_disk(str(path))
    if isinstance(dataset, datasets.DatasetDict):
        dataset = dataset["train"] if "train" in dataset else next(iter(dataset.values()))
    if field not in dataset.column_names:
        raise ConfigError(f"{path}: no column {field!r}; columns: {dataset.column_names}")
    yield from (str(v) for v in dataset[field])


def _require(module: str, path: pathlib.Path, what: str) -> None:
    """Refuses now (before anything is written) a source whose reader is not installed."""
    try:
        __import__(module)
    except ImportError:
        raise ConfigDependencyError(f"{path}: {what}: pip install {module}") from None


def read_documents(path: str | os.PathLike, *, field: str = "text", text_unit: str = "file"):
    """The documents of one source, by its kind: a directory saved by `datasets`, `.jsonl`,
    `.parquet`, or text (`text_unit`: one document per file, paragraph or line). The kind and
    its reader are checked at the call; the file is read as the documents are."""
    path = pathlib.Path(path)
    if field == RECORD and (path.is_dir() or path.suffix not in (".jsonl", ".json")):
        raise ConfigFileError(f"{path}: whole records are read from JSONL files (.jsonl)")
    if path.is_dir():
        _require("datasets", path, "a saved Hugging Face dataset needs `datasets`")
        return _dataset_documents(path, field)
    if not path.is_file():
        raise ConfigFileError(f"prepare-data: {str(path)!r} does not exist")
    if path.suffix in (".jsonl", ".json"):
        return _jsonl_documents(path, field)
    if path.suffix == ".parquet":
        _require("pyarrow", path, "reading Parquet needs pyarrow")
        return _parquet_documents(path, field)
    if text_unit not in TEXT_UNITS:
        raise ConfigError(f"text unit {text_unit!r}: one of {TEXT_UNITS}")
    return _text_documents(path, text_unit)


def chunks(sources, field, text_unit, size) -> Iterator[list[str]]:
    """The documents of every source in order, in lists of `size` (the last may be shorter)."""
    chunk: list[str] = []
    for source in sources:
        for doc in read_documents(source, field=field, text_unit=text_unit):
            chunk.append(doc)
            if len(chunk) == size:
                yield chunk
                chunk = []
    if chunk:
        yield chunk
