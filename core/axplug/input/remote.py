"""Data directories behind a storage backend (`s3://bucket/data`): paths, sizes, range reads.

A `RemotePath` stands where a `pathlib.Path` does for a local directory, and `RemoteArray`
where a memory map does: slicing it reads that range of the file (one request), so a host
reads the rows it trains on and nothing else.
"""

from __future__ import annotations

import os
import pathlib
from typing import Any

import numpy as np

__all__ = ["RemotePath", "RemoteArray", "data_path", "is_url", "local_tokenizer"]


def is_url(location: str | os.PathLike) -> bool:
    """Whether `location` names a storage URL other than the local filesystem."""
    text = os.fspath(location)
    scheme, sep, _ = text.partition("://")
    return bool(sep and scheme) and scheme.lower() != "file"


class RemotePath:
    """A file or directory URL of a storage backend, with the `pathlib` parts data code uses."""

    def __init__(self, url: str, storage: Any):
        self.url = url.rstrip("/")
        self.storage = storage

    def __str__(self) -> str:
        return self.url

    def __repr__(self) -> str:
        return f"RemotePath({self.url!r})"

    def __truediv__(self, name: str) -> RemotePath:
        return RemotePath(f"{self.url}/{name}", self.storage)

    @property
    def name(self) -> str:
        return self.url.rsplit("/", 1)[-1]

    @property
    def stem(self) -> str:
        return self.name.rsplit(".", 1)[0] if "." in self.name else self.name

    @property
    def parent(self) -> RemotePath:
        return RemotePath(self.url.rsplit("/", 1)[0], self.storage)

    def with_name(self, name: str) -> RemotePath:
        return self.parent / name

    def is_file(self) -> bool:
        try:
            self.storage.size(self.url)
        except FileNotFoundError:
            return False
        return True

    def size(self) -> int:
        return self.storage.size(self.url)

    def read_bytes(self) -> bytes:
        return self.storage.read_bytes(self.url)

    def read_text(self, encoding: str = "utf-8") -> str:
        return self.read_bytes().decode(encoding)


def data_path(location: str | os.PathLike, storage_options: dict | None = None):
    """A local `pathlib.Path`, or a `RemotePath` on the backend of the URL's scheme."""
    if not is_url(location):
        text = os.fspath(location)
        return pathlib.Path(text[len("file://") :] if text.startswith("file://") else text)
    from axplug.checkpoint.storage import storage_for

    return RemotePath(os.fspath(location), storage_for(os.fspath(location), storage_options))


class RemoteArray:
    """A read-only 1-D array of `dtype` stored in a file of a storage backend; `[i]` and
    `[lo:hi]` read those elements with one range request."""

    def __init__(self, path: RemotePath, dtype: np.dtype, length: int):
        self.path, self.dtype, self._length = path, np.dtype(dtype), length

    def __len__(self) -> int:
        return self._length

    @property
    def shape(self) -> tuple[int]:
        return (self._length,)

    def __getitem__(self, index):
        if isinstance(index, slice):
            lo, hi, step = index.indices(self._length)
            if step != 1:
                raise IndexError("RemoteArray reads contiguous ranges only")
            return self._read(lo, max(hi - lo, 0))
        i = int(index) + (self._length if int(index) < 0 else 0)
        if not 0 <= i < self._length:
            raise IndexError(f"index {index} out of range for {self._length} elements")
        return self._read(i, 1)[0]

    def _read(self, start: int, count: int) -> np.ndarray:
        if count == 0:
            return np.zeros(0, self.dtype)
        size = self.dtype.itemsize
        data = self.path.storage.read_bytes(self.path.url, start * size, count * size)
        if len(data) != count * size:
            raise OSError(
                f"{self.path}: read {len(data)} bytes at {start * size}, expected {count * size} "
                "(the file changed or was cut short?)"
            )
        return np.frombuffer(data, self.dtype)

    def __array__(self, dtype=None, copy=None):
        out = self._read(0, self._length)
        return out if dtype is None else out.astype(dtype)


def local_tokenizer(url: str, storage_options: dict | None = None) -> str:
    """A data directory URL's tokenizer, copied into the local cache: its path ("bytes" for
    byte data), for the tokenizer libraries, which read local files."""
    import hashlib
    import json

    from axplug.files import atomic_file

    root = data_path(url, storage_options)
    meta = json.loads((root / "meta.json").read_text())
    name = meta.get("tokenizer")
    if name == "bytes" or not isinstance(name, str):
        return "bytes"
    data = (root / name).read_bytes()
    from axplug.paths import CACHE, cache_path

    local = (
        pathlib.Path(cache_path(f"{CACHE}/tokenizers"))
        / hashlib.sha256(data).hexdigest()[:16]
        / name
    )
    if not local.is_file():
        local.parent.mkdir(parents=True, exist_ok=True)
        with atomic_file(local) as f:
            f.write(data)
    return str(local)
