"""The documents of `prepare-data`'s sources: text, JSONL or Parquet files, read in order (a
record or line that cannot be read is named by file and line), or `NAME:SPEC`, read by the
`axplug.data_sources` entry NAME (a directory: read by the data source decorated with
`reads_directories`, such as a dataset saved by Hugging Face `datasets`)."""

from __future__ import annotations

import json
import os
import pathlib
import re
from collections.abc import Callable, Iterator

from axplug import registry
from axplug.config import ConfigDependencyError, ConfigError, ConfigFileError

__all__ = [
    "read_documents",
    "chunks",
    "source_kind",
    "reads_directories",
    "TEXT_UNITS",
    "RECORD",
    "DATA_SOURCES",
]

TEXT_UNITS = ("file", "paragraph", "line")
RECORD = "*"  # the field that means a JSONL line's whole object (a chat, a preference pair)
DATA_SOURCES = "data_sources"  # the registry kind: `documents(spec, *, field) -> Iterator`
_NAME = re.compile(r"[a-z][a-z0-9_-]+")  # one letter is a drive (`c:\data`)
_INSTALL = "docs/your-data.md names the first-party data sources to install"
_DIRECTORY_READERS: set[Callable] = set()


def reads_directories(documents: Callable) -> Callable:
    """Declares a data source function the reader of directories (`prepare-data DIR`)."""
    _DIRECTORY_READERS.add(documents)
    return documents


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


def _require(module: str, path: pathlib.Path, what: str) -> None:
    """Refuses now (before anything is written) a source whose reader is not installed."""
    try:
        __import__(module)
    except ImportError:
        raise ConfigDependencyError(f"{path}: {what}: pip install {module}") from None


def source_kind(source: str | os.PathLike) -> tuple[str, str] | None:
    """(NAME, SPEC) of a source `NAME:SPEC` that the data source NAME reads, None for a path.

    NAME is lower case (`[a-z][a-z0-9_-]+`) and registered in `axplug.data_sources`; a path
    that exists, a drive (`C:\\...`) and a URL (`s3://...`) stay paths."""
    name, sep, spec = str(source).partition(":")
    if not sep or not _NAME.fullmatch(name) or spec.startswith("//") or os.path.exists(source):
        return None
    if any(c.name == name for c in registry.discover(DATA_SOURCES)):
        return name, spec
    return None


def _plugin_documents(name: str, spec: str, field: str, what: str) -> Iterator:
    """The documents of the data source `name`: it checks `spec` now and reads lazily."""
    try:
        documents = registry.load(DATA_SOURCES, name)
    except registry.ComponentUnavailableError as e:
        raise ConfigDependencyError(f"prepare-data: {what}: {e}") from None
    except registry.ComponentNotFoundError:
        raise ConfigDependencyError(
            f"prepare-data: {what}: no {name!r} data source is installed ({_INSTALL})"
        ) from None
    except (registry.ComponentConflictError, registry.PluginLoadError) as e:
        raise ConfigDependencyError(f"prepare-data: {what}: {e}") from None
    return documents(spec, field=field)


def _directory_source(source: str) -> str:
    """The installed data source declared `reads_directories` (a saved dataset's)."""
    for component in registry.discover(DATA_SOURCES):
        reader = registry.load(DATA_SOURCES, component.name) if component.loadable else None
        if reader in _DIRECTORY_READERS:
            return component.name
    raise ConfigDependencyError(
        f"prepare-data: {source!r} is a directory, and no installed data source reads one "
        f"(a dataset saved by Hugging Face `datasets` is read by one; {_INSTALL})"
    )


def read_documents(path: str | os.PathLike, *, field: str = "text", text_unit: str = "file"):
    """The documents of one source, by its kind: `NAME:SPEC` for a registered data source (a
    directory: one saved by `datasets`, read by the `hf-disk` one), `.jsonl`, `.parquet`, or
    text (`text_unit`: one document per file, paragraph or line). The kind and its reader are
    checked at the call; the file is read as the documents are."""
    source = str(path)
    if kind := source_kind(source):
        return _plugin_documents(*kind, field, repr(source))
    path = pathlib.Path(path)
    if path.is_dir():
        return _plugin_documents(_directory_source(source), source, field, repr(source))
    if field == RECORD and path.suffix not in (".jsonl", ".json"):
        raise ConfigFileError(f"{path}: whole records are read from JSONL files (.jsonl)")
    if not path.is_file():
        name, sep, rest = source.partition(":")
        named = sep and _NAME.fullmatch(name) and not rest.startswith("//")
        hint = f" (nor a data source NAME:SPEC; {_INSTALL})" if named else ""
        raise ConfigFileError(f"prepare-data: {source!r} does not exist{hint}")
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
