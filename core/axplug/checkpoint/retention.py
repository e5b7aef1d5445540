"""Which steps a `Checkpointer` keeps: the last `keep_last`, plus every multiple of `keep_every`."""

from __future__ import annotations

from typing import Any

import jax

from axplug.checkpoint import inventory, layout
from axplug.checkpoint.storage import Storage

__all__ = ["check_retention", "apply_retention"]


def check_retention(cfg: Any) -> None:
    """ConfigError naming `keep_last` or `keep_every` of the Checkpointer config `cfg` when
    the policy would keep nothing (or divide by zero)."""
    if cfg.keep_last < 1:
        raise cfg.field_error("keep_last", f"must be at least 1, got {cfg.keep_last}")
    if cfg.keep_every is not None and cfg.keep_every < 1:
        raise cfg.field_error("keep_every", f"must be None or at least 1, got {cfg.keep_every}")


def apply_retention(
    storage: Storage, directory: str, steps: list[int], keep_last: int, keep_every: int | None
) -> None:
    """Deletes the complete `steps` the policy does not keep; process 0 only."""
    if jax.process_index() != 0:  # every process writes its shards; one deletes old steps
        return
    keep = layout.steps_to_keep(steps, keep_last, keep_every)
    for step in steps:
        if step not in keep:
            inventory.delete_step(storage, directory, step)
