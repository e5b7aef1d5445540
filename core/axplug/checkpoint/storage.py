"""Where checkpoints live: a small `Storage` interface, chosen by URL scheme, and local files.

A backend is a `Storage` subclass registered in the `axplug.storage` entry point group under
its URL scheme; the local filesystem (`file`, and plain paths) ships with the core this way.
A cloud plugin adds e.g. `s3 = "my_pkg.storage:MyObjectStorage"`. Every method takes the full URL
(`s3://bucket/run/checkpoints/step_00000010`); `join` builds child URLs. Orbax writes the
arrays itself, to the `epath.Path` that `path()` returns; the other methods are what the
checkpointer needs around that: listing steps, checking completion markers, reading the
metadata JSON and deleting old steps.
"""

from __future__ import annotations

import abc
import os
import shutil
from typing import TYPE_CHECKING, Any

from axplug.checkpoint.errors import StorageNotFoundError
from axplug.files import atomic_file, write_text

if TYPE_CHECKING:
    from etils import epath

__all__ = ["Storage", "LocalStorage", "scheme_of", "storage_for"]


class Storage(abc.ABC):
    """A storage backend addressed by URLs of one scheme; subclass it to add a scheme."""

    #: Whether orbax may commit a save by renaming a temporary directory (true on local
    #: filesystems). Object stores set False: orbax then writes into the final directory and
    #: commits by writing `commit_success.txt` last. Both ways leave that file in a complete step.
    atomic_rename: bool = True

    @abc.abstractmethod
    def path(self, url: str) -> epath.Path:
        """The `etils.epath.Path` that orbax reads and writes for `url`."""

    @abc.abstractmethod
    def exists(self, url: str) -> bool:
        """Whether a file or directory exists at `url`."""

    @abc.abstractmethod
    def listdir(self, url: str) -> list[str]:
        """Names (not URLs) of the entries directly under `url`; [] when it does not exist."""

    @abc.abstractmethod
    def delete(self, url: str) -> None:
        """Deletes the file or the whole directory tree at `url`; a missing `url` is no error."""

    @abc.abstractmethod
    def read_text(self, url: str) -> str:
        """The UTF-8 text of the file at `url` (FileNotFoundError when missing)."""

    @abc.abstractmethod
    def write_text(self, url: str, text: str) -> None:
        """Writes `text` as UTF-8 to the file at `url`, creating parent directories."""

    def join(self, url: str, *names: str) -> str:
        """`url` with `names` appended as path components."""
        return "/".join([url.rstrip("/"), *names])

    #: How long a store that does not answer is waited for (a read repeated, a save retried)
    #: before the run exits 75; 0: not at all (a local filesystem has no outages).
    outage_s: float = 0.0

    def is_outage(self, exc: BaseException) -> bool:
        """Whether `exc` means the store did not answer (retry), not a refusal or a missing file."""
        return False

    def check(self, url: str) -> None:
        """Raises an error naming `url` when it cannot be reached (server, bucket, credentials)."""
        # Called once when a Checkpointer is built, so a bad URL fails before training starts.
        return None

    def stat(self, url: str) -> tuple[int | None, float | None]:
        """(total bytes, newest mtime in epoch seconds) of the tree at `url`; None when unknown."""
        return None, None

    # Data directories (plugin API 1.9): token shards read by range, written by upload.

    def size(self, url: str) -> int:
        """The byte size of the file at `url` (FileNotFoundError when missing)."""
        raise self._missing("size")

    def read_bytes(self, url: str, start: int = 0, length: int | None = None) -> bytes:
        """Bytes `[start, start + length)` of the file at `url` (to its end when None): one
        range request on an object store (FileNotFoundError when missing)."""
        raise self._missing("read_bytes")

    def put_file(self, local_path: str | os.PathLike, url: str) -> None:
        """Uploads the local file to `url` whole: a reader sees all of it or nothing."""
        raise self._missing("put_file")

    def _missing(self, method: str) -> NotImplementedError:
        return NotImplementedError(
            f"storage backend {type(self).__qualname__} has no {method}() (plugin API 1.9), "
            "so token data cannot be read or written through it; upgrade the plugin that "
            "provides it"
        )


class LocalStorage(Storage):
    """The local filesystem: plain paths and `file://` URLs."""

    def _local(self, url: str) -> str:
        if url.startswith("file://"):
            url = url[len("file://") :]
        return os.path.abspath(os.path.expanduser(url))

    def path(self, url: str) -> epath.Path:
        from etils import epath  # imported on use: listing plugins must stay light

        return epath.Path(self._local(url))

    def exists(self, url: str) -> bool:
        return os.path.exists(self._local(url))

    def listdir(self, url: str) -> list[str]:
        try:
            return sorted(os.listdir(self._local(url)))
        except (FileNotFoundError, NotADirectoryError):
            return []

    def delete(self, url: str) -> None:
        local = self._local(url)
        if os.path.isdir(local) and not os.path.islink(local):
            shutil.rmtree(local, ignore_errors=False)
        elif os.path.lexists(local):
            os.remove(local)

    def read_text(self, url: str) -> str:
        with open(self._local(url), encoding="utf-8") as f:
            return f.read()

    def write_text(self, url: str, text: str) -> None:
        # Under a temporary name, then renamed: a reader (or a killed writer) never leaves a
        # half-written file at `url`.
        write_text(self._local(url), text)

    def size(self, url: str) -> int:
        return os.path.getsize(self._local(url))

    def read_bytes(self, url: str, start: int = 0, length: int | None = None) -> bytes:
        with open(self._local(url), "rb") as f:
            f.seek(start)
            return f.read(-1 if length is None else length)

    def put_file(self, local_path: str | os.PathLike, url: str) -> None:
        target = self._local(url)
        if os.path.abspath(local_path) == target:
            return
        os.makedirs(os.path.dirname(target), exist_ok=True)
        with atomic_file(target) as f, open(local_path, "rb") as src:
            shutil.copyfileobj(src, f)

    def stat(self, url: str) -> tuple[int | None, float | None]:
        local = self._local(url)
        if not os.path.exists(local):
            return None, None
        files = [local]
        if os.path.isdir(local):
            files = [os.path.join(d, f) for d, _, names in os.walk(local) for f in names]
        stats = [os.stat(f) for f in files]
        return sum(s.st_size for s in stats), max((s.st_mtime for s in stats), default=None)


def scheme_of(url: str) -> str:
    """The URL scheme of `url` (`s3` for `s3://b/x`); a plain path is `file`."""
    scheme, sep, _ = url.partition("://")
    return scheme.lower() if sep and scheme else "file"


def storage_for(url: str, options: dict[str, Any] | None = None) -> Storage:
    """The backend registered for `url`'s scheme in `axplug.storage`, built with `options`."""
    from axplug import registry

    scheme = scheme_of(url)
    try:
        cls = registry.load("storage", scheme)
    except registry.ComponentNotFoundError:
        installed = ", ".join(registry.names("storage")) or "none"
        raise StorageNotFoundError(
            f"no storage backend for scheme {scheme!r} (url {url}): install the plugin that "
            "registers it in the entry point group axplug.storage (docs/your-data.md names the "
            f"first-party one for object stores; installed schemes: {installed})"
        ) from None
    storage = cls(**(options or {}))
    if not isinstance(storage, Storage):
        raise TypeError(
            f"storage backend {scheme!r} built a {type(storage).__qualname__}, which is not an "
            "axplug.checkpoint.Storage; backends must subclass it"
        )
    return storage
