"""On-storage layout of a checkpoint directory: step names, completion marker, retention."""

from __future__ import annotations

import re
from collections.abc import Iterable

__all__ = [
    "STEP_PREFIX",
    "COMMIT_MARKER",
    "STATE_ITEM",
    "METADATA_ITEM",
    "METADATA_FILE",
    "CHECKSUMS_ITEM",
    "TEMP_SUFFIX",
    "step_dir_name",
    "parse_step",
    "parse_partial_step",
    "steps_to_keep",
]

STEP_PREFIX = "step_"
# orbax 0.12.8 writes this file last in both commit modes: into the temporary directory just
# before the atomic rename (local files), or into the final directory (object stores).
COMMIT_MARKER = "commit_success.txt"
STATE_ITEM = "state"
METADATA_ITEM = "metadata"
METADATA_FILE = "metadata"  # orbax JsonCheckpointHandler's default file name in its item dir
CHECKSUMS_ITEM = "checksums"  # {leaf name: checksum} (axplug.checkpoint.checksum); JSON too

# orbax writes a step into `step_00000009.orbax-checkpoint-tmp[...]` and renames it when done
# (local files); one left behind is a save in progress, or one that was killed.
TEMP_SUFFIX = ".orbax-checkpoint-tmp"

# Exact match: orbax's `step_00000009.orbax-checkpoint-tmp...` temporary dirs never parse.
_STEP_RE = re.compile(re.escape(STEP_PREFIX) + r"(\d{8,})")
_PARTIAL_RE = re.compile(re.escape(STEP_PREFIX) + r"(\d{8,})" + re.escape(TEMP_SUFFIX) + ".*")


def step_dir_name(step: int) -> str:
    """`step_00000042` for step 42: eight digits at least, so names sort like steps."""
    return f"{STEP_PREFIX}{step:08d}"


def parse_step(name: str) -> int | None:
    """The step of a step directory name, or None for anything else (temp dirs, stray files)."""
    m = _STEP_RE.fullmatch(name)
    return int(m.group(1)) if m else None


def parse_partial_step(name: str) -> int | None:
    """The step of orbax's temporary directory of a step, or None for anything else."""
    m = _PARTIAL_RE.fullmatch(name)
    return int(m.group(1)) if m else None


def steps_to_keep(steps: Iterable[int], keep_last: int, keep_every: int | None) -> set[int]:
    """The last `keep_last` of `steps`, plus every multiple of `keep_every`."""
    ordered = sorted(set(steps))
    keep = set(ordered[-keep_last:]) if keep_last > 0 else set()
    if keep_every:
        keep.update(s for s in ordered if s % keep_every == 0)
    return keep
