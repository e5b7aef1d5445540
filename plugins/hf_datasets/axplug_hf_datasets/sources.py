"""The `hf` and `hf-disk` data sources: Hugging Face datasets as `prepare-data` sources.

    hf:NAME[:CONFIG[:SPLIT]]   a Hub dataset (`owner/name`) or a local dataset directory,
                               streamed: load_dataset(NAME, CONFIG, split=SPLIT, streaming=True)
    hf:LOADER:FILES            data files through a `datasets` loader (json, jsonl, csv,
                               parquet, text, arrow), streamed; FILES a path or glob, several
                               joined by ','
    hf-disk:DIR[:SPLIT]        a dataset saved by `save_to_disk` (memory-mapped, not copied);
                               `hf:DIR` and a plain directory source read it too

SPLIT defaults to `train` (a saved DatasetDict without one: its first split); CONFIG may be
left empty (`hf:NAME::test`). NAME, DIR and FILES may hold ':' (a Windows drive): the longest
':'-joined prefix that exists locally is the path. Each entry checks the spec when called
(files exist, the loader, name, config, split and, where the features are known, the column)
and returns a lazy iterator: records are read as the documents are taken, in dataset order.
A null value is no document; the `text` loader's blank lines are none either.
"""

from __future__ import annotations

import difflib
import glob
import os
import re
from collections.abc import Iterable, Iterator
from typing import Any, NamedTuple

from axplug.api.config import ConfigDependencyError, ConfigError, ConfigFileError
from axplug.api.data import reads_directories

__all__ = [
    "LOADERS",
    "HubSpec",
    "hub_documents",
    "disk_documents",
    "parse_hub_spec",
    "parse_disk_spec",
]

RECORD = "*"  # the core's field meaning the whole record (axplug.input.sources.RECORD)
DEFAULT_SPLIT = "train"
# The loader names of `hf:LOADER:FILES`, by the `datasets` packaged module that reads them.
LOADERS = {
    "json": "json",
    "jsonl": "json",
    "csv": "csv",
    "parquet": "parquet",
    "text": "text",
    "arrow": "arrow",
}
GRAMMAR = (
    "hf:NAME[:CONFIG[:SPLIT]] (a Hub dataset or a dataset directory), hf:LOADER:FILES "
    f"(LOADER one of {', '.join(LOADERS)}) or hf-disk:DIR[:SPLIT] (saved by save_to_disk)"
)
_SPLIT = re.compile(r"\w+(\.\w+)*")  # what `datasets` accepts as a split name
_FILE_SUFFIXES = (".jsonl", ".json", ".csv", ".tsv", ".parquet", ".txt", ".arrow")
_LOCAL = re.compile(r"[.~/\\]|[A-Za-z]:[\\/]")  # how a path starts; a Hub name never does
_GLOB = re.compile(r"[*?[]")


class HubSpec(NamedTuple):
    """An `hf:` spec: `path` is the loader (`json`, ...) with `data_files`, else the Hub name
    or local directory; `split` None means the default."""

    path: str
    config: str | None
    split: str | None
    data_files: list[str] | None


def parse_hub_spec(spec: str) -> HubSpec:
    """The parts of `hf:SPEC`; local data files must exist (ConfigFileError names the one that
    does not), a loader name must be known. No network, no import of `datasets`."""
    what = f"hf:{spec}"
    head, _, files = spec.partition(":")
    if head in LOADERS:
        if not files:
            raise ConfigError(f"{what}: name the data files: hf:{head}:FILES (a path or glob)")
        return HubSpec(LOADERS[head], None, None, _data_files(files, what))
    path, rest = _local_prefix(spec)
    if not path:
        raise ConfigError(f"{what}: no dataset named; {GRAMMAR}")
    if len(rest) > 2:
        raise ConfigError(f"{what}: too many ':' parts; {GRAMMAR}")
    config = (rest[0] or None) if rest else None
    split = _split(rest[1] if len(rest) > 1 else "", what)
    if not os.path.exists(path):
        _check_remote_name(path, config, what)
    elif os.path.isfile(path):
        loader = next((n for n in LOADERS if path.endswith(f".{n}")), "LOADER")
        raise ConfigError(f"{what}: {path!r} is a file: read data files as hf:{loader}:{path}")
    return HubSpec(path, config, split, None)


def parse_disk_spec(spec: str) -> tuple[str, str | None]:
    """(directory, split or None) of `hf-disk:DIR[:SPLIT]`; the directory must exist."""
    what = f"hf-disk:{spec}"
    path, rest = _local_prefix(spec)
    if not os.path.isdir(path):
        raise ConfigFileError(f"{what}: no directory {path!r} (one written by save_to_disk)")
    if len(rest) > 1:
        raise ConfigError(f"{what}: too many ':' parts; hf-disk:DIR[:SPLIT]")
    return path, _split(rest[0] if rest else "", what)


def hub_documents(spec: str, *, field: str) -> Iterator[str | dict]:
    """The `hf` data source: the documents of `hf:SPEC` (the column `field`, or whole records
    for `*`), streamed in dataset order. Checks the spec now, reads as they are taken."""
    what = f"hf:{spec}"
    parsed = parse_hub_spec(spec)
    if parsed.data_files is None and _saved_dataset(parsed.path):
        if parsed.config is not None:
            raise ConfigError(f"{what}: a dataset saved by save_to_disk has no config")
        return _disk_documents(parsed.path, parsed.split, field, what)
    datasets = _datasets(what)
    split = parsed.split or DEFAULT_SPLIT
    options: dict[str, Any] = {}
    if parsed.data_files is not None:
        options["data_files"] = {split: parsed.data_files}
        if parsed.path == "parquet" and field != RECORD:
            options["columns"] = [field]  # only that column is read
    dataset = _load(datasets, parsed.path, parsed.config, split, options, what)
    if field != RECORD and (columns := _columns(dataset)) is not None and field not in columns:
        if "columns" in options:  # the projection hid the columns there are
            del options["columns"]
            columns = _columns(_load(datasets, parsed.path, None, split, options, what))
        raise ConfigError(f"{what}: no column {field!r}; columns: {columns} (use --field NAME)")
    return _documents(dataset, field, what, skip_blank=parsed.path == "text")


@reads_directories  # the core's directories
def disk_documents(spec: str, *, field: str) -> Iterator[str | dict]:
    """The `hf-disk` data source (and the core's directory source): the documents of a
    dataset saved by `save_to_disk`, in order. Checks now, reads as they are taken."""
    path, split = parse_disk_spec(spec)
    return _disk_documents(path, split, field, f"hf-disk:{spec}")


def _disk_documents(path: str, split: str | None, field: str, what: str) -> Iterator:
    if not _saved_dataset(path):
        raise ConfigFileError(
            f"{what}: {path!r} is not a dataset saved by save_to_disk (no dataset_dict.json, "
            f"nor state.json and dataset_info.json); data files: hf:json:{path}/*.jsonl, a "
            f"dataset repository: hf:{path}"
        )
    datasets = _datasets(what)
    try:
        dataset = datasets.load_from_disk(path)  # memory-mapped: nothing is read yet
    except Exception as e:
        raise _load_error(e, what) from None
    if isinstance(dataset, datasets.DatasetDict):
        splits = list(dataset)
        split = split or (DEFAULT_SPLIT if DEFAULT_SPLIT in dataset else splits[0])
        if split not in dataset:
            raise ConfigError(f"{what}: no split {split!r}; splits: {splits}")
        dataset = dataset[split]
    elif split is not None and split != str(dataset.split):
        raise ConfigError(f"{what}: one saved dataset (split {dataset.split}), no split {split!r}")
    if field != RECORD:
        if field not in dataset.column_names:
            raise ConfigError(
                f"{what}: no column {field!r}; columns: {dataset.column_names} (use --field NAME)"
            )
        dataset = dataset.select_columns([field])
    return _documents(dataset, field, what)


def _documents(rows: Iterable[dict], field: str, what: str, skip_blank: bool = False):
    """The documents of `rows`, read as they are taken; a failure midway is a ConfigError
    naming the source and how many records were read."""
    count = 0
    try:
        for record in rows:
            count += 1
            if field == RECORD:
                yield dict(record)
                continue
            if field not in record:
                raise ConfigError(
                    f"{what}: record {count}: no column {field!r}; columns: {list(record)} "
                    "(use --field NAME)"
                )
            value = record[field]
            if value is None or (skip_blank and not str(value).strip()):
                continue
            yield str(value)
    except ConfigError:
        raise
    except Exception as e:  # `datasets` and pyarrow raise many kinds: one error, naming it
        raise ConfigError(f"{what}: unreadable after {count} records: {_summary(e)}") from e


def _load(datasets, path, config, split, options, what):
    try:
        return datasets.load_dataset(path, config, split=split, streaming=True, **options)
    except Exception as e:  # nothing is downloaded: streaming only resolves the files
        raise _load_error(e, what) from None


def _columns(dataset) -> list[str] | None:
    """The column names where the features are known before reading (not for JSON, CSV)."""
    features = getattr(dataset, "features", None)
    return None if features is None else list(features)


def _local_prefix(spec: str) -> tuple[str, list[str]]:
    """(path, the ':' parts after it): the longest ':'-joined prefix of `spec` that exists
    locally (a Windows drive, a directory with ':' in its name), else the first part."""
    parts = spec.split(":")
    for end in range(len(parts), 0, -1):
        candidate = os.path.expanduser(":".join(parts[:end]))
        if candidate and os.path.exists(candidate):
            return candidate, parts[end:]
    return os.path.expanduser(parts[0]), parts[1:]


def _split(split: str, what: str) -> str | None:
    if split and not _SPLIT.fullmatch(split):
        raise ConfigError(f"{what}: {split!r} is not a split name (train, test, ...)")
    return split or None


def _check_remote_name(name: str, config: str | None, what: str) -> None:
    """Refuses what is not there and cannot be a Hub name: a path, a loader misspelt."""
    if _LOCAL.match(name) or name.endswith(_FILE_SUFFIXES):
        use = f"; data files: hf:LOADER:{name}" if name.endswith(_FILE_SUFFIXES) else ""
        raise ConfigFileError(f"{what}: no directory {name!r}{use}")
    if config is not None and "/" not in name and _looks_like_files(config):
        close = difflib.get_close_matches(name, list(LOADERS), n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ConfigError(
            f"{what}: unknown loader {name!r}{hint}; hf:LOADER:FILES takes one of "
            f"{', '.join(LOADERS)}"
        )


def _looks_like_files(text: str) -> bool:
    return any(c in text for c in "/\\*?,") or text.endswith(_FILE_SUFFIXES)


def _data_files(files: str, what: str) -> list[str]:
    """The loader form's files, in order: each local one must exist (a glob must match)."""
    pieces = [files] if os.path.isfile(os.path.expanduser(files)) else files.split(",")
    out = []
    for piece in filter(None, pieces):
        if "://" in piece:  # hf://, https://: `datasets` resolves it
            out.append(piece)
            continue
        path = os.path.abspath(os.path.expanduser(piece))
        if _GLOB.search(piece):
            if not glob.glob(path, recursive=True):
                raise ConfigFileError(f"{what}: no file matches {piece!r}")
        elif os.path.isdir(path):
            raise ConfigFileError(
                f"{what}: {piece!r} is a directory: name its files ({piece}/*.jsonl, ...)"
            )
        elif not os.path.isfile(path):
            head, sep, tail = piece.rpartition(":")
            split = sep and os.path.exists(os.path.expanduser(head)) and _SPLIT.fullmatch(tail)
            hint = " (hf:LOADER:FILES takes no split: the files are the data)" if split else ""
            raise ConfigFileError(f"{what}: no file {piece!r}{hint}")
        out.append(path)
    if not out:
        raise ConfigError(f"{what}: no data files named")
    return out


def _saved_dataset(path: str) -> bool:
    """Whether `path` is a directory `save_to_disk` wrote (a Dataset or a DatasetDict)."""
    exists = os.path.isfile
    return exists(os.path.join(path, "dataset_dict.json")) or (
        exists(os.path.join(path, "state.json")) and exists(os.path.join(path, "dataset_info.json"))
    )


def _datasets(what: str):
    try:
        import datasets
    except ImportError:
        raise ConfigDependencyError(
            f"{what}: reading it needs `datasets`: pip install datasets"
        ) from None
    return datasets


def _load_error(e: Exception, what: str) -> ConfigError:
    if isinstance(e, FileNotFoundError):
        return ConfigFileError(f"{what}: {_summary(e, named=False)}")
    if isinstance(e, ConnectionError):
        return ConfigError(
            f"{what}: {_summary(e, named=False)} (a Hub dataset streams from the network: check "
            "the name, the connection, HF_HUB_OFFLINE / HF_DATASETS_OFFLINE, and HF_TOKEN for a "
            "gated one)"
        )
    return ConfigError(f"{what}: {_summary(e)}")


def _summary(e: BaseException, named: bool = True) -> str:
    lines = str(e).strip().splitlines()
    text = lines[0] if lines else ""
    if not named and text:
        return text
    return f"{type(e).__name__}: {text}" if text else type(e).__name__
