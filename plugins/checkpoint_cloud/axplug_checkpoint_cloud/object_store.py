"""`ObjectStorage`: the `Storage` file operations on a bucket through fsspec, with clear errors."""

from __future__ import annotations

import abc
import contextlib
import datetime
import logging
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from axplug.api.checkpoint import Storage, StoreOutageError
from axplug.api.config import ConfigValueError
from axplug.api.run import RESTART_EXIT_CODE

if TYPE_CHECKING:
    import fsspec
    from etils import epath

__all__ = [
    "ObjectStorage",
    "StoreOutageError",
    "reject_secrets",
    "RetryBudget",
    "forget_epath_filesystems",
]

log = logging.getLogger("axplug.storage")
DEFAULT_OUTAGE_S = 120.0  # how long reads and saves wait for a server that does not answer


_NO_BUCKET = "the bucket does not exist; create it, or fix the URL"
# Option names that would carry a secret by value; credentials are named by source instead.
_SECRET_WORDS = ("secret", "password", "token_value", "access_key", "session_token", "key_id")


def reject_secrets(scheme: str, options: dict[str, Any], allowed: tuple[str, ...]) -> None:
    """Raises ConfigValueError for an option that would put a credential into the config."""
    for name in options:
        if name not in allowed and any(word in name.lower() for word in _SECRET_WORDS):
            raise ConfigValueError(
                f"{scheme} storage option {name!r}: credentials are never taken from the "
                "config (it is written to config.txt and into every checkpoint); use the "
                "standard environment variables, or `profile`/`credentials_file`"
            )


class RetryBudget:
    """How often and how long a request to the store is retried before the save fails."""

    def __init__(self, max_retries: int, initial_delay_s: float, max_delay_s: float):
        if max_retries < 0 or initial_delay_s <= 0 or max_delay_s < initial_delay_s:
            raise ConfigValueError(
                "retry budget: need max_retries >= 0 and 0 < retry_initial_delay_s <= "
                f"retry_max_delay_s, got {max_retries}, {initial_delay_s}, {max_delay_s}"
            )
        self.max_retries = max_retries
        self.initial_delay_s = initial_delay_s
        self.max_delay_s = max_delay_s

    def tensorstore(self) -> dict[str, Any]:
        """The `*_request_retries` context resource of tensorstore's s3 and gcs drivers."""
        return {
            "max_retries": self.max_retries,
            "initial_delay": f"{self.initial_delay_s}s",
            "max_delay": f"{self.max_delay_s}s",
        }


def forget_epath_filesystems() -> None:
    """Drops etils.epath's cached fsspec filesystems, so it sees new fsspec settings."""
    from etils.epath import backend

    cached: Any = getattr(backend.fsspec_backend, "_get_filesystem", None)
    if hasattr(cached, "cache_clear"):
        cached.cache_clear()


def _mtime(info: dict[str, Any]) -> float | None:
    value = info.get("LastModified") or info.get("updated") or info.get("mtime")
    if isinstance(value, datetime.datetime):
        return value.timestamp()
    if isinstance(value, str):
        try:
            return datetime.datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()
        except ValueError:
            return None
    return float(value) if isinstance(value, (int, float)) else None


class ObjectStorage(Storage):
    """A bucket-backed `Storage`: URLs `SCHEME://bucket/key`; orbax commits by marker file."""

    atomic_rename = False
    scheme: str = ""

    @property
    @abc.abstractmethod
    def endpoint_name(self) -> str:
        """The server, for error messages (`http://127.0.0.1:9000`, or the provider's)."""

    @abc.abstractmethod
    def _new_filesystem(self) -> fsspec.AbstractFileSystem:
        """A fresh fsspec filesystem for this backend's endpoint and credentials."""

    @abc.abstractmethod
    def _orbax_path(self, url: str) -> epath.Path:
        """Registers the bucket's tensorstore settings and returns orbax's path for `url`."""

    # -- URLs --------------------------------------------------------------------------------

    def split(self, url: str) -> tuple[str, str]:
        """(bucket, key) of `url`; ValueError when it is not `SCHEME://bucket[/key]`."""
        scheme, sep, rest = url.partition("://")
        bucket, _, key = rest.partition("/")
        if not sep or scheme.lower() not in self.schemes or not bucket:
            raise ConfigValueError(f"not a {self.scheme}:// URL with a bucket: {url!r}")
        return bucket, key.strip("/")

    @property
    def schemes(self) -> tuple[str, ...]:
        return (self.scheme,)

    def _key(self, url: str) -> str:
        bucket, key = self.split(url)
        return f"{bucket}/{key}" if key else bucket

    @property
    def fs(self) -> fsspec.AbstractFileSystem:
        if getattr(self, "_fs", None) is None:
            self._fs = self._new_filesystem()
        return self._fs

    # -- Storage -----------------------------------------------------------------------------

    def path(self, url: str) -> epath.Path:
        self.split(url)
        return self._orbax_path(url)

    def exists(self, url: str) -> bool:
        with self._errors(url):
            return self.fs.exists(self._key(url))

    def listdir(self, url: str) -> list[str]:
        key = self._key(url)
        try:
            with self._errors(url):
                entries = self.fs.ls(key, detail=True)
        except FileNotFoundError:
            return []
        names = {entry["name"].rstrip("/").rsplit("/", 1)[-1] for entry in entries}
        only = entries[0] if len(entries) == 1 else {}
        if only.get("type") == "file" and only["name"].rstrip("/") == key:
            return []  # `url` is a file, not a directory
        return sorted(n for n in names if n)

    def delete(self, url: str) -> None:
        key = self._key(url)
        try:
            with self._errors(url):
                if self.fs.isdir(key):
                    self.fs.rm(key, recursive=True)
                elif self.fs.exists(key):
                    self.fs.rm_file(key)
        except FileNotFoundError:
            pass

    def read_text(self, url: str) -> str:
        with self._errors(url):
            return self.fs.cat_file(self._key(url)).decode("utf-8")

    def write_text(self, url: str, text: str) -> None:
        # Object stores have no directories to create: the parents exist once a child does.
        with self._errors(url, missing=_NO_BUCKET):
            self.fs.pipe_file(self._key(url), text.encode("utf-8"))

    def stat(self, url: str) -> tuple[int | None, float | None]:
        with self._errors(url):
            found = self.fs.find(self._key(url), detail=True)
        if not found:
            return None, None
        times = [t for t in (_mtime(info) for info in found.values()) if t is not None]
        return sum(int(info.get("size") or 0) for info in found.values()), max(times, default=None)

    def size(self, url: str) -> int:
        with self._errors(url):
            return int(self.fs.size(self._key(url)))

    def read_bytes(self, url: str, start: int = 0, length: int | None = None) -> bytes:
        end = None if length is None else start + length
        if length == 0:
            return b""
        return self._patiently(url, lambda: self.fs.cat_file(self._key(url), start=start, end=end))

    outage_s: float = DEFAULT_OUTAGE_S

    def is_outage(self, exc: BaseException) -> bool:
        # A connection refused, reset or timed out anywhere in the chain (fsspec's and the
        # clients' own errors, wrapped); tensorstore's writes say so by status code, or by
        # the transport's (curl's) error, which an answer such as access denied never carries.
        seen: BaseException | None = exc
        while seen is not None:
            if isinstance(seen, (ConnectionError, TimeoutError)) or any(
                code in str(seen) for code in ("UNAVAILABLE", "DEADLINE_EXCEEDED", "CURL error")
            ):
                return True
            seen = seen.__cause__ or seen.__context__
        return False

    def _patiently(self, url: str, read: Callable[[], bytes]) -> bytes:
        """`read()`, retried while the server does not answer (an outage, not a refusal or a
        missing object) for up to `outage_s`; then a StoreOutageError, exit 75: the run's
        state is safe at its newest checkpoint, and a restart resumes from it."""
        deadline, delay, warned = time.monotonic() + self.outage_s, 0.5, False
        while True:
            try:
                with self._errors(url):
                    return read()
            except ConnectionError as exc:
                if time.monotonic() + delay > deadline:
                    raise StoreOutageError(
                        f"{exc}; no answer for {self.outage_s:g} s (storage option outage_s). "
                        f"Exit {RESTART_EXIT_CODE}: the run's state is safe at its newest "
                        "complete checkpoint; rerun the command to resume from it"
                    ) from None
                if not warned:
                    log.warning("%s; retrying for up to %g s", exc, self.outage_s)
                    warned = True
                time.sleep(delay)
                delay = min(2 * delay, 10.0)

    def put_file(self, local_path, url: str) -> None:
        # One PUT (or a multipart upload completed at the end): the object appears whole.
        with self._errors(url, missing=_NO_BUCKET):
            self.fs.put_file(str(local_path), self._key(url))

    def check(self, url: str) -> None:
        bucket, _ = self.split(url)
        with self._errors(url, missing=_NO_BUCKET):
            self.fs.ls(bucket, detail=False)

    @contextlib.contextmanager
    def _errors(self, url: str, *, missing: str | None = None) -> Iterator[None]:
        """Re-raises the store's errors with the bucket, the endpoint and what to do."""
        bucket, _ = self.split(url)
        where = f"bucket {bucket!r} at {self.endpoint_name} (url {url})"
        try:
            yield
        except FileNotFoundError as exc:
            if missing is None:
                raise
            raise FileNotFoundError(f"{where}: {missing}") from exc
        except PermissionError as exc:
            raise PermissionError(
                f"{where}: access denied ({exc}); check the credentials "
                f"({self.credentials_source}) and the bucket's permissions"
            ) from None
        except Exception as exc:  # botocore and aiohttp errors are not all OSErrors
            raise ConnectionError(
                f"{where}: cannot reach the server ({type(exc).__name__}: {exc}); check the "
                "endpoint and that the server is up"
            ) from None

    @property
    def credentials_source(self) -> str:
        """Where the credentials come from, in words (never the credentials themselves)."""
        return "the default credential chain"
