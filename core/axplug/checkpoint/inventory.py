"""What a checkpoint directory holds, step by step, and deleting one step safely."""

from __future__ import annotations

import dataclasses

from axplug.checkpoint import layout
from axplug.checkpoint.storage import Storage, storage_for

__all__ = ["StepInfo", "list_steps", "delete_step", "resolve_checkpoint_dir"]


@dataclasses.dataclass(frozen=True)
class StepInfo:
    """One step directory: its step, whether it is complete, its size and last change.

    `partial`: orbax's temporary directory of the step (a save in progress, or one killed
    before its rename), never complete, listed beside the step's own directory if any.
    """

    step: int
    url: str
    complete: bool
    size_bytes: int | None = None  # None when the backend cannot tell
    mtime: float | None = None  # seconds since the epoch, newest file in the step
    partial: bool = False

    @property
    def state(self) -> str:
        """`complete`, `incomplete` (no completion marker) or `partial` (a temporary dir)."""
        return "partial" if self.partial else "complete" if self.complete else "incomplete"


def list_steps(storage: Storage, directory: str, *, sizes: bool = False) -> list[StepInfo]:
    """Every step directory under `directory`, complete or not, and the temporary directories
    of saves in progress or killed (`partial`), ascending by step."""
    infos = []
    for name in storage.listdir(directory):
        url = storage.join(directory, name)
        step = layout.parse_step(name)
        if step is None:
            if (step := layout.parse_partial_step(name)) is None:
                continue
            # Its completion marker may be written already: it is renamed into place after.
            size, mtime = storage.stat(url) if sizes else (None, None)
            infos.append(StepInfo(step, url, False, size, mtime, partial=True))
            continue
        complete = storage.exists(storage.join(url, layout.COMMIT_MARKER))
        size, mtime = storage.stat(url) if sizes else (None, None)
        infos.append(StepInfo(step, url, complete, size, mtime))
    return sorted(infos, key=lambda info: (info.step, info.partial, info.url))


def delete_step(storage: Storage, directory: str, step: int) -> bool:
    """Deletes one step directory, its completion marker first; False when it was not there.

    On an object store a directory is deleted object by object: removing the marker first
    means a deletion cut short leaves an incomplete step, never a complete-looking partial one.
    """
    url = storage.join(directory, layout.step_dir_name(step))
    if not storage.exists(url):
        return False
    storage.delete(storage.join(url, layout.COMMIT_MARKER))
    storage.delete(url)
    return True


def checkpoint_directory(path: str) -> str:
    """The checkpoints directory of a run: `path/checkpoints` when it exists, else `path`."""
    storage = storage_for(path)
    nested = storage.join(path, "checkpoints")
    return nested if storage.exists(nested) else path


def resolve_checkpoint_dir(storage: Storage, url: str) -> str:
    """`url` if it holds step directories (or partial ones), else `url/checkpoints` when that
    does (a run dir)."""
    if _holds_steps(storage.listdir(url)):
        return url
    # Asked directly rather than looked for in the listing: some S3 servers leave
    # "directories" out of a delimited listing.
    nested = storage.join(url, "checkpoints")
    if _holds_steps(storage.listdir(nested)):
        return nested
    return url


def _holds_steps(names: list[str]) -> bool:
    return any(
        layout.parse_step(n) is not None or layout.parse_partial_step(n) is not None for n in names
    )
