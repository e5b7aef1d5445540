"""Prepared data directories (what `axplug prepare-data` writes), written atomically and checked.

A directory holds `meta.json`, the tokenizer file, and shards: `shard_NNNNN.bin` (the token ids
of whole documents, each ending with the tokenizer's EOS when it has one; uint16 or uint32) with
`shard_NNNNN.docs.npy` (int64 document start offsets in the shard, plus its length), and when
meta.json says `"loss_mask": true`, `shard_NNNNN.mask.bin` (a uint8 per token: 1 where the
loss counts predicting that token, e.g. the assistant's turns of a chat). meta.json
lists each shard with its `tokens`, `documents` and `max_token_id` (the largest id in it;
directories from older versions lack it). Shards are written whole and renamed into place, so a
directory is never half a shard, and `meta.json` is written last.

`open_shards` checks what is cheap (every file's size against meta.json and its docs.npy, the
recorded largest ids, and each shard's first and last token, against `vocab_size`) without
reading the tokens; `verify` reads them all.
Every refusal is a `ConfigFileError` naming the file and what to do.
"""

from __future__ import annotations

import io
import json
import os
import pathlib
import re
from typing import Any, NamedTuple

import numpy as np

from axplug.config import ConfigFileError
from axplug.files import atomic_file
from axplug.input.remote import RemoteArray, RemotePath, data_path

__all__ = [
    "TOKEN_DIR_FORMAT",
    "DTYPES",
    "Shard",
    "read_meta",
    "open_shard",
    "open_shards",
    "verify",
    "out_of_vocab",
    "write_shard",
]

TOKEN_DIR_FORMAT = "axplug-tokens-1"
DTYPES = ("uint16", "uint32")
_AGAIN = "copy it again or rerun prepare-data"
_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*")  # a file name in the directory, no path
_CHUNK = 1 << 24  # tokens read at a time by `verify`


class Shard(NamedTuple):
    """One opened shard: its `.bin` path, tokens (memory mapped), document offsets, and the
    per-token loss mask of a data directory that has them."""

    path: pathlib.Path
    tokens: np.ndarray
    docs: np.ndarray  # [documents + 1], starts then the length
    mask: np.ndarray | None = None


def _int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def file_size(path) -> int:
    """The byte size of a local or remote file."""
    return path.size() if isinstance(path, RemotePath) else path.stat().st_size


def read_meta(
    directory: str | os.PathLike | RemotePath, storage_options: dict | None = None
) -> dict:
    """The `meta.json` of a prepared data directory (a path or a storage URL), checked."""
    root = directory if isinstance(directory, RemotePath) else data_path(directory, storage_options)
    path = root / "meta.json"
    if not path.is_file():
        raise ConfigFileError(
            f"{str(directory)!r} is not a prepared data directory (no meta.json); make one with "
            "`axplug prepare-data FILES --tokenizer PATH --output DIR`"
        )
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigFileError(f"{path}: not JSON ({e}; an incomplete copy?): {_AGAIN}") from None
    if not isinstance(meta, dict):
        raise ConfigFileError(f"{path}: not a JSON object: {_AGAIN}")
    if meta.get("format") != TOKEN_DIR_FORMAT:
        raise ConfigFileError(
            f"{path}: format {meta.get('format')!r}, expected {TOKEN_DIR_FORMAT!r}"
        )
    if meta.get("dtype") not in DTYPES:
        raise ConfigFileError(f"{path}: dtype {meta.get('dtype')!r}, expected one of {DTYPES}")
    vocab = meta.get("vocab_size")
    if not _int(vocab) or vocab < 1:
        raise ConfigFileError(f"{path}: vocab_size {vocab!r}, expected an integer >= 1")
    shards = meta.get("shards")
    if not isinstance(shards, list):
        raise ConfigFileError(f"{path}: shards {shards!r}, expected a list of shard records")
    for i, shard in enumerate(shards):
        where = f"{path}: shards[{i}]"
        if not isinstance(shard, dict):
            raise ConfigFileError(f"{where}: {shard!r}, expected an object")
        name = shard.get("name")
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise ConfigFileError(f"{where}.name: {name!r}, expected a file name like shard_00000")
        for key in ("tokens", "documents", "max_token_id"):
            value = shard.get(key)
            if value is not None and (not _int(value) or value < 0):
                raise ConfigFileError(f"{where}.{key}: {value!r}, expected an integer >= 0")
    return meta


def open_shard(root: pathlib.Path | RemotePath, meta: dict, record: dict) -> Shard:
    """A shard, its size, docs.npy and recorded largest id checked (no token is read)."""
    path = root / f"{record['name']}.bin"
    dtype = np.dtype(meta["dtype"])
    if not path.is_file():
        raise ConfigFileError(f"{path}: missing (meta.json lists it): {_AGAIN}")
    size = file_size(path)
    if size % dtype.itemsize:
        raise ConfigFileError(
            f"{path}: {size} bytes, not a whole number of {dtype.name} tokens "
            f"(an incomplete copy?): {_AGAIN}"
        )
    n = size // dtype.itemsize
    if record.get("tokens") is not None and record["tokens"] != n:
        raise ConfigFileError(
            f"{path}: {n} tokens, meta.json says {record['tokens']} (an incomplete copy?): {_AGAIN}"
        )
    docs_path = root / f"{record['name']}.docs.npy"
    if not docs_path.is_file():
        raise ConfigFileError(
            f"{docs_path}: missing (the document offsets of {path.name}): {_AGAIN}"
        )
    try:
        docs = np.load(io.BytesIO(docs_path.read_bytes()), allow_pickle=False)
    except (ValueError, OSError, EOFError) as e:
        raise ConfigFileError(f"{docs_path}: not a readable .npy file ({e}): {_AGAIN}") from None
    if docs.ndim != 1 or docs.dtype.kind not in "iu" or len(docs) < 1:
        raise ConfigFileError(
            f"{docs_path}: {docs.dtype} {list(docs.shape)}, expected int64 document offsets: "
            f"{_AGAIN}"
        )
    docs = docs.astype(np.int64)
    if docs[0] != 0 or np.any(np.diff(docs) < 0) or docs[-1] != n:
        raise ConfigFileError(
            f"{docs_path}: document offsets run from {docs[0]} to {docs[-1]} but {path.name} "
            f"holds {n} tokens (an incomplete copy?): {_AGAIN}"
        )
    if record.get("documents") is not None and record["documents"] != len(docs) - 1:
        raise ConfigFileError(
            f"{docs_path}: {len(docs) - 1} documents, meta.json says {record['documents']}: "
            f"{_AGAIN}"
        )
    largest = record.get("max_token_id")
    if largest is not None and largest >= meta["vocab_size"]:
        raise ConfigFileError(
            f"{path}: token ids up to {largest} (meta.json), outside the vocabulary of "
            f"{meta['vocab_size']} (meta.json's vocab_size): the shard was prepared with another "
            f"tokenizer; rerun prepare-data"
        )
    tokens = file_array(path, dtype, n)
    for at in sorted({0, n - 1}) if n else ():  # two pages: a shard overwritten whole shows
        if tokens[at] >= meta["vocab_size"]:
            raise ConfigFileError(out_of_vocab(path, int(tokens[at]), at, meta["vocab_size"]))
    mask = None
    if meta.get("loss_mask"):
        mask_path = root / f"{record['name']}.mask.bin"
        if not mask_path.is_file() or file_size(mask_path) != n:
            raise ConfigFileError(
                f"{mask_path}: missing or not one byte per token of {path.name} (meta.json "
                f"says the data has loss masks): {_AGAIN}"
            )
        mask = file_array(mask_path, np.uint8, n)
    return Shard(path, tokens, docs, mask)


def file_array(path, dtype, n: int):
    """The file's `n` elements: memory mapped, or read by range from a storage backend."""
    if isinstance(path, RemotePath):
        return RemoteArray(path, dtype, n)
    # An empty file cannot be memory mapped.
    return np.memmap(path, dtype=dtype, mode="r") if n else np.zeros(0, dtype)


def out_of_vocab(path, token: int, at: int, vocab_size: int) -> str:
    """The refusal of a token id outside the vocabulary, which a gather would clamp silently."""
    return (
        f"{path}: token id {token} at token {at} is outside the vocabulary of {vocab_size} "
        f"(meta.json's vocab_size; a damaged shard?): check it with `axplug data verify "
        f"{path.parent}`, then copy it again or rerun prepare-data"
    )


def open_shards(
    directory: str | os.PathLike | RemotePath, meta: dict | None = None,
    storage_options: dict | None = None,
) -> list[Shard]:  # fmt: skip
    """Every shard of a data directory, checked as far as it can be without reading tokens."""
    root = directory if isinstance(directory, RemotePath) else data_path(directory, storage_options)
    meta = read_meta(root) if meta is None else meta
    return [open_shard(root, meta, record) for record in meta["shards"]]


def verify(directory: str | os.PathLike, vocab_size: int | None = None,
           storage_options: dict | None = None) -> dict:  # fmt: skip
    """Reads every token of a data directory; returns a summary, or raises naming the file.

    Beyond `open_shards`: each shard's largest id equals the one meta.json records, and every
    id is below `vocab_size` (meta.json's, and the given one: a model's)."""
    root = data_path(directory, storage_options)
    meta = read_meta(root)
    shards = open_shards(root, meta)
    bounds = [(meta["vocab_size"], "meta.json's vocab_size")]
    if vocab_size is not None:
        bounds.append((vocab_size, "--vocab-size"))
    largest = -1
    for shard, record in zip(shards, meta["shards"], strict=True):
        top = max((int(shard.tokens[i : i + _CHUNK].max()) for i in
                   range(0, len(shard.tokens), _CHUNK)), default=None)  # fmt: skip
        if record.get("max_token_id", top) != top:
            raise ConfigFileError(
                f"{shard.path}: largest token id {top}, meta.json says "
                f"{record['max_token_id']} (changed after prepare-data?): {_AGAIN}"
            )
        for bound, what in bounds:
            if top is not None and top >= bound:
                at = _first_at_least(shard.tokens, bound)
                raise ConfigFileError(
                    f"{shard.path}: token id {int(shard.tokens[at])} at token {at} is outside "
                    f"the vocabulary of {bound} ({what}): {_AGAIN}"
                )
        largest = max(largest, -1 if top is None else top)
    tokenizer = meta.get("tokenizer")
    if isinstance(tokenizer, str) and tokenizer != "bytes" and not (root / tokenizer).is_file():
        raise ConfigFileError(f"{root / tokenizer}: missing (meta.json names it): {_AGAIN}")
    return {
        "shards": len(shards),
        "documents": sum(len(s.docs) - 1 for s in shards),
        "tokens": sum(len(s.tokens) for s in shards),
        "max_token_id": largest,
        "vocab_size": meta["vocab_size"],
        "dtype": meta["dtype"],
    }


def _first_at_least(tokens: np.ndarray, bound: int) -> int:
    """The offset of the first token >= `bound` (one exists)."""
    for i in range(0, len(tokens), _CHUNK):
        hits = np.flatnonzero(tokens[i : i + _CHUNK] >= bound)
        if len(hits):
            return i + int(hits[0])
    raise AssertionError("no token >= bound")


def write_shard(
    directory: pathlib.Path, name: str, documents: list, dtype: str, masks: list | None = None
) -> dict:
    """Writes the documents (lists of ids; with `masks`, a 0/1 list per document) as shard
    `name` atomically, the mask file first; returns its record."""
    if masks is not None:
        flat = np.fromiter((m for d in masks for m in d), dtype=np.uint8)
        with atomic_file(directory / f"{name}.mask.bin") as f:
            flat.tofile(f)
    lengths = np.fromiter((len(d) for d in documents), dtype=np.int64, count=len(documents))
    starts = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    tokens = np.fromiter(
        (t for d in documents for t in d), dtype=np.dtype(dtype), count=int(starts[-1])
    )
    for suffix, write in ((".bin", tokens.tofile), (".docs.npy", lambda f: np.save(f, starts))):
        with atomic_file(directory / f"{name}{suffix}") as f:
            write(f)
    return {
        "name": name,
        "tokens": int(starts[-1]),
        "documents": len(documents),
        "max_token_id": int(tokens.max()) if len(tokens) else None,
    }
