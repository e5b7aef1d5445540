"""Writing files and directories so that none looks complete before it is: a file goes to a
temporary name beside it and is renamed into place; a directory is filled under a temporary
name beside it and renamed into place whole. Every command and plugin that writes a file a
reader may open uses these.

Every write error is an `OSError` naming the file written (a full disk: errno ENOSPC and the
path, which the CLI reports as "no space left on <device> writing <path>"), and a failed write
leaves no temporary file behind.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import shutil
import threading
from collections.abc import Iterator
from typing import IO, Any

__all__ = [
    "TEMP_MARK",
    "temp_path",
    "atomic_file",
    "write_text",
    "copy_file",
    "is_temp_of",
    "named_os_error",
    "errors_naming",
    "staged_directory",
    "remove_stale_stages",
]

TEMP_MARK = ".tmp-"  # `.NAME.tmp-PID`: a file or directory being written by process PID
_OLD_MARK = ".old-"  # `.NAME.old-PID`: the directory a --force export is replacing
_CHUNK = 4 * 2**20
_UMASK = os.umask(0o022)  # read (and put back) once: a file written here gets its modes
os.umask(_UMASK)


def temp_path(path: str, mark: str = TEMP_MARK) -> str:
    """`dir/.name.tmp-PID` of `dir/name`: a hidden name in the same directory (one rename)."""
    head, name = os.path.split(os.path.abspath(path))
    return os.path.join(head, f".{name}{mark}{os.getpid()}")


def is_temp_of(entry: str, names: tuple[str, ...] | list[str]) -> bool:
    """Whether the directory entry `entry` is a temporary file of one of `names`."""
    return any(entry.startswith(f".{name}{TEMP_MARK}") for name in names)


def named_os_error(exc: OSError, path: str | os.PathLike) -> OSError:
    """`exc` naming `path` when it names no file (a failed `write` or flush names none).

    numpy's `tofile` reports a short write as `OSError: N requested and M written`, with no
    errno: a full disk, said as one."""
    short = exc.errno is None and "requested and" in str(exc)
    if exc.filename is not None and not short:
        return exc
    code = errno.ENOSPC if short else exc.errno if exc.errno is not None else errno.EIO
    strerror = os.strerror(code) if short else exc.strerror or os.strerror(code)
    return OSError(code, strerror, os.fspath(path))


@contextlib.contextmanager
def errors_naming(path: str | os.PathLike) -> Iterator[None]:
    """Re-raises an `OSError` of the block that names no file as one naming `path`."""
    try:
        yield
    except OSError as exc:
        named = named_os_error(exc, path)
        if named is exc:
            raise
        raise named from exc


@contextlib.contextmanager
def _removed_on_failure(temporary: str, path: str) -> Iterator[None]:
    """Removes `temporary` when the block fails; its `OSError` then names `path`."""
    try:
        with errors_naming(path):
            yield
    except BaseException:
        _remove(temporary)
        raise


@contextlib.contextmanager
def atomic_file(path: str | os.PathLike, mode: str = "wb") -> Iterator[IO[Any]]:
    """A file to write (`mode` "wb" or "w", UTF-8) whose content appears at `path` only once
    it is all written."""
    path = os.fspath(path)
    tmp = f"{temp_path(path)}-{threading.get_ident()}"  # threads of one process write too
    with _removed_on_failure(tmp, path):
        with open(tmp, mode, encoding=None if "b" in mode else "utf-8") as f:
            yield f
        os.replace(tmp, path)


def write_text(path: str | os.PathLike, text: str) -> None:
    """Writes `text` (UTF-8) to `path` atomically, creating its directory."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with atomic_file(path, "w") as f:
        f.write(text)


def copy_file(source: str, target: str) -> None:
    """Copies `source` to `target` atomically (`target` is the old file or the whole copy)."""
    with open(source, "rb") as src, atomic_file(target) as dst:
        shutil.copyfileobj(src, dst, _CHUNK)


def _remove(path: str) -> None:
    with contextlib.suppress(OSError):
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path)
        else:
            os.remove(path)


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return False  # a stage of ours from before (a reused pid) is stale too
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process
    return True


def remove_stale_stages(path: str) -> list[str]:
    """Deletes the temporary directories of `path` (`.name.tmp-PID`, `.name.old-PID`) whose
    process is gone (a killed export); returns their paths."""
    head, name = os.path.split(os.path.abspath(path))
    pattern = re.compile(rf"^\.{re.escape(name)}(?:{TEMP_MARK}|{_OLD_MARK})(\d+)$")
    removed = []
    with contextlib.suppress(FileNotFoundError):
        for entry in os.listdir(head):
            m = pattern.match(entry)
            if m and not _alive(int(m.group(1))):
                _remove(os.path.join(head, entry))
                removed.append(os.path.join(head, entry))
    return removed


@contextlib.contextmanager
def staged_directory(path: str, *, replace: bool) -> Iterator[str]:
    """A new directory to fill that becomes `path` only once the block completes.

    `path` must be missing or empty, unless `replace`: then the old directory is renamed
    aside, the new one renamed in, and only then the old one deleted, so `path` is at every
    moment the old directory or the new one, whole. A failed block leaves `path` as it was.
    """
    stage = temp_path(path)
    _remove(stage)
    with _removed_on_failure(stage, path):
        os.makedirs(stage)
        yield stage
        for root, _, names in os.walk(stage):  # the umask's modes (safetensors writes 0600)
            for name in names:
                os.chmod(os.path.join(root, name), 0o666 & ~_UMASK)
        _commit(stage, path, replace)


def _commit(stage: str, path: str, replace: bool) -> None:
    if not os.path.isdir(path):
        os.rename(stage, path)
        return
    if not os.listdir(path):
        os.rmdir(path)
        os.rename(stage, path)
        return
    if not replace:
        raise FileExistsError(errno.EEXIST, "filled while the export was written", path)
    old = temp_path(path, _OLD_MARK)
    _remove(old)
    os.rename(path, old)
    os.rename(stage, path)
    shutil.rmtree(old, ignore_errors=True)
