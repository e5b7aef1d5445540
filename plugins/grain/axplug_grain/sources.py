"""Random-access sources of token documents for Grain: ArrayRecord and Parquet files.

Record format. Each document is a list of int token ids (prepared: each ends with the
tokenizer's EOS when it has one).

- ArrayRecord (`.array_record`): each record is the UTF-8 JSON object `{FIELD: [ids...]}`
  (other keys are ignored), FIELD being the input's `field` ("tokens" by default).
  `write_array_record(path, documents)` writes such a file.
- Parquet (`.parquet`): a column FIELD of lists of integers, one row per document.
  `write_parquet(path, documents)` writes such a file. A Parquet file's column is read into
  memory the first time a document of it is read (random access for a global shuffle).

`DocumentSource` concatenates the files in order and returns each document as an int32
array, checked: a record without FIELD, ids that are not integers, or an id outside
`[0, vocab_size)` raises a `ConfigFileError` naming the file, the record and the field.
"""

from __future__ import annotations

import bisect
import glob
import json
import os
import pathlib
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from axplug.api.checkpoint import temp_path
from axplug.api.config import ConfigFileError

__all__ = [
    "ARRAY_RECORD",
    "PARQUET",
    "DocumentSource",
    "resolve_paths",
    "write_array_record",
    "write_parquet",
]

ARRAY_RECORD = ".array_record"
PARQUET = ".parquet"
_GLOB = set("*?[")


def _kind(path: str) -> str | None:
    """ARRAY_RECORD, PARQUET, or None for a file of neither kind (sharded ArrayRecord names
    such as `x.array_record-00000-of-00008` count as ArrayRecord)."""
    name = pathlib.Path(path).name
    if name.endswith(PARQUET):
        return PARQUET
    if ARRAY_RECORD in name:
        return ARRAY_RECORD
    return None


def resolve_paths(patterns: Sequence[str]) -> list[str]:
    """The files that `patterns` (paths or glob patterns, `~` expanded) name, in the given
    order (a pattern's matches sorted); raises a message naming the first one that fails."""
    out: list[str] = []
    for pattern in patterns:
        expanded = os.path.expanduser(pattern)
        if _GLOB & set(expanded):
            matches = sorted(p for p in glob.glob(expanded) if os.path.isfile(p))
            if not matches:
                raise FileNotFoundError(f"{pattern}: no file matches this pattern")
        elif os.path.isfile(expanded):
            matches = [expanded]
        else:
            raise FileNotFoundError(f"{pattern}: no such file")
        for path in matches:
            if _kind(path) is None:
                raise FileNotFoundError(
                    f"{path}: not an ArrayRecord ({ARRAY_RECORD}) or Parquet ({PARQUET}) file"
                )
        out.extend(matches)
    return out


class _ArrayRecordFile:
    """One ArrayRecord file of JSON records, opened lazily (pickles without its reader)."""

    def __init__(self, path: str):
        self.path = path
        self._source = None
        self.length = len(self._open())

    def _open(self):
        if self._source is None:
            import grain

            try:
                self._source = grain.sources.ArrayRecordDataSource([self.path])
            except Exception as e:  # array_record raises RuntimeError/ValueError subclasses
                raise ConfigFileError(f"{self.path}: not a readable ArrayRecord file ({e})") from e
        return self._source

    def __getstate__(self):
        return {"path": self.path, "length": self.length, "_source": None}

    def tokens(self, index: int, field: str):
        raw = self._open()[index]
        try:
            record = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ConfigFileError(
                f"{self.path}: record {index} is not a JSON object ({e}); records are "
                f'UTF-8 JSON like {{"{field}": [ids...]}} (axplug_grain.write_array_record)'
            ) from None
        if not isinstance(record, dict) or field not in record:
            keys = sorted(record) if isinstance(record, dict) else type(record).__name__
            raise ConfigFileError(
                f"{self.path}: record {index} has no field {field!r} (it has {keys}); set the "
                "input's `field` to the key that holds the token ids"
            )
        return record[field]


class _ParquetFile:
    """One Parquet file's FIELD column, read whole on first use (pickles without it)."""

    def __init__(self, path: str, field: str):
        import pyarrow.parquet as pq

        self.path = path
        self._column: Any = None
        try:
            schema = pq.read_schema(path)
            self.length = pq.ParquetFile(path).metadata.num_rows
        except Exception as e:  # pyarrow.ArrowInvalid and OSError
            raise ConfigFileError(f"{path}: not a readable Parquet file ({e})") from e
        if field not in schema.names:
            raise ConfigFileError(
                f"{path}: no column {field!r} (it has {schema.names}); set the input's "
                "`field` to the column that holds the token ids"
            )

    def __getstate__(self):
        return {"path": self.path, "length": self.length, "_column": None}

    def tokens(self, index: int, field: str):
        if self._column is None:
            import pyarrow.parquet as pq

            self._column = pq.read_table(self.path, columns=[field], memory_map=True).column(0)
        value = self._column[index]
        if not value.is_valid:
            raise ConfigFileError(f"{self.path}: row {index} has a null {field!r}")
        values = getattr(value, "values", None)
        if values is None:
            raise ConfigFileError(
                f"{self.path}: column {field!r} holds {value.type}, not lists of token ids"
            )
        return values.to_numpy(zero_copy_only=False)


class DocumentSource:
    """The documents of `paths` in order, each an int32 array of ids in [0, vocab_size)
    (a Grain `RandomAccessDataSource`: `len` and `[index]`)."""

    def __init__(self, paths: Sequence[str], field: str, vocab_size: int):
        self.field = field
        self.vocab_size = vocab_size
        self.files = [
            _ArrayRecordFile(p) if _kind(p) == ARRAY_RECORD else _ParquetFile(p, field)
            for p in paths
        ]
        self.starts = [0]
        for f in self.files:
            self.starts.append(self.starts[-1] + f.length)

    def __len__(self) -> int:
        return self.starts[-1]

    def __repr__(self) -> str:
        return f"DocumentSource({len(self.files)} files, {len(self)} documents)"

    def __getitem__(self, index: int) -> np.ndarray:
        index = int(index)
        if not 0 <= index < len(self):
            raise IndexError(f"document {index} of {len(self)}")
        i = bisect.bisect_right(self.starts, index) - 1
        file, local = self.files[i], index - self.starts[i]
        values = file.tokens(local, self.field)
        what = f"{file.path}: record {local} field {self.field!r}"
        try:
            ids = np.asarray(values)
        except (ValueError, TypeError):
            ids = np.asarray([], dtype=object)
        if ids.ndim != 1 or (ids.size and ids.dtype.kind not in "iu"):
            raise ConfigFileError(f"{what}: expected a list of integer token ids")
        if ids.size:
            low, high = int(ids.min()), int(ids.max())
            if low < 0 or high >= self.vocab_size:
                bad = low if low < 0 else high
                raise ConfigFileError(
                    f"{what}: token id {bad} is outside the vocabulary of {self.vocab_size} "
                    "(the input's vocab_size; the data was tokenized with another tokenizer?)"
                )
        return ids.astype(np.int32)


def _documents(documents: Iterable) -> list[list[int]]:
    return [[int(t) for t in doc] for doc in documents]


def _atomically(path: str | os.PathLike, write) -> str:
    """Calls `write(temporary path)`, then renames it to `path`: a reader never sees half."""
    path = os.fspath(path)
    temp = temp_path(path)
    try:
        write(temp)
        os.replace(temp, path)
    finally:
        if os.path.exists(temp):
            os.remove(temp)
    return path


def write_array_record(
    path: str | os.PathLike, documents: Iterable, *, field: str = "tokens"
) -> str:
    """Writes `documents` (lists of int token ids) as an ArrayRecord file of JSON records
    `{field: [ids...]}`, one per document, atomically; returns the path."""
    from array_record.python.array_record_module import ArrayRecordWriter

    docs = _documents(documents)

    def write(temp: str) -> None:
        writer = ArrayRecordWriter(temp, "group_size:1")
        try:
            for doc in docs:
                writer.write(json.dumps({field: doc}, separators=(",", ":")).encode())
        finally:
            writer.close()

    return _atomically(path, write)


def write_parquet(path: str | os.PathLike, documents: Iterable, *, field: str = "tokens") -> str:
    """Writes `documents` as a Parquet file with a column `field` of int32 lists, atomically;
    returns the path."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.table({field: pa.array(_documents(documents), type=pa.list_(pa.int32()))})
    return _atomically(path, lambda temp: pq.write_table(table, temp))
