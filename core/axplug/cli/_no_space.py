"""The one line of a full disk: `no space left on DEVICE (mounted at DIR) writing PATH`."""

from __future__ import annotations

import errno
import os
import re

__all__ = ["is_no_space", "no_space_message", "mount_of"]

# A full quota reads the same to the user: the write cannot go on until space is freed.
_NO_SPACE = {errno.ENOSPC, errno.EDQUOT}


def is_no_space(exc: BaseException) -> bool:
    """True for an OSError that says the disk (or the user's quota) is full."""
    return isinstance(exc, OSError) and exc.errno in _NO_SPACE


def no_space_message(exc: OSError) -> str:
    """`no space left on /dev/sda1 (mounted at /data) writing /data/run/x: ...` for `exc`."""
    # A copy or a rename names (source, destination): the destination is what was written.
    path = exc.filename2 if exc.filename2 is not None else exc.filename
    if path is None:
        return (
            f"no space left on device ({exc.strerror or exc}): free space on the disk the "
            "command writes to, or write elsewhere, then rerun"
        )
    path = os.fsdecode(path)
    mount, device = mount_of(path)
    where = mount if device is None else f"{device} (mounted at {mount})"
    full = "no space left" if exc.errno == errno.ENOSPC else "disk quota exceeded"
    return f"{full} on {where} writing {path}: free space there, or write elsewhere, then rerun"


def mount_of(path: str) -> tuple[str, str | None]:
    """(mount point, device or None when unknown) of the filesystem `path` is (or would be) on:
    that of its nearest existing parent."""
    current = os.path.abspath(path)
    while not os.path.exists(current) and os.path.dirname(current) != current:
        current = os.path.dirname(current)
    current = os.path.realpath(current)
    while not os.path.ismount(current):
        current = os.path.dirname(current)
    return current, _device(current)


def _device(mount: str) -> str | None:
    """The source of `mount` in /proc/self/mounts (Linux; the last mount there wins)."""
    try:
        with open("/proc/self/mounts", encoding="utf-8", errors="replace") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    device = None
    for line in lines:
        fields = line.split()
        if len(fields) >= 2 and _unescape(fields[1]) == mount:
            device = _unescape(fields[0])
    return device


def _unescape(field: str) -> str:
    # /proc/self/mounts writes space, tab, newline and backslash as octal escapes (\040).
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)
