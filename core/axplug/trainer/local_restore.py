"""Which tier a run resumes from: the local tier's newest step complete on every process, when
it is newer than the persistent tier's latest and saved on this layout; else the persistent.

Every process lists its own usable local steps and the processes agree on them with
`process_allgather`, so a local directory lost with its machine (or one process's save cut
short) sends every process to the persistent tier together. The persistent directory holds
a run id (`local_tier_run`, written once by process 0) that every local save records: local
steps left by an earlier run into a directory since replaced are never restored.
"""

from __future__ import annotations

import logging
import uuid
from typing import Any

import jax
import numpy as np

from axplug.checkpoint.integrity import first_line

__all__ = ["RUN_ID_FILE", "restore_newer_local", "discard_newer_local"]

log = logging.getLogger("axplug.trainer")
RUN_ID_FILE = "local_tier_run"


def _shared_run_id(checkpointer: Any) -> str:
    """The run id in the persistent directory, created by process 0 when missing."""
    storage, url = (
        checkpointer.storage,
        checkpointer.storage.join(checkpointer.directory, RUN_ID_FILE),
    )
    if jax.process_index() == 0 and not storage.exists(url):
        storage.write_text(url, uuid.uuid4().hex + "\n")
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices("axplug local tier run id")
    return storage.read_text(url).strip()


def _gather(values: list[int]) -> list[list[int]]:
    """Every process's `values` (non-negative ints), by process index."""
    if jax.process_count() == 1:
        return [values]
    from jax.experimental import multihost_utils

    longest = int(np.max(multihost_utils.process_allgather(np.int32(len(values)))))
    padded = np.full(max(longest, 1), -1, np.int32)
    padded[: len(values)] = values
    rows = multihost_utils.process_allgather(padded)
    return [[int(v) for v in row if v >= 0] for row in np.asarray(rows)]


def restore_newer_local(checkpointer: Any, target: Any) -> tuple[int, Any] | None:
    """`(step, state)` restored as `target` (abstract arrays) from `checkpointer`'s local tier
    when it holds, on every process, a usable step newer than the persistent tier's latest;
    else None (the reason logged)."""
    local = checkpointer.local
    if local is None:
        return None
    local.run_id = _shared_run_id(checkpointer)
    persistent = checkpointer.latest_step()
    mine = []
    for step in local.complete_steps():
        if persistent is not None and step <= persistent:
            continue  # the persistent tier holds it (or a newer one)
        if (why := local.unusable(step, target, local.run_id)) is not None:
            log.info("local tier: not restoring step %d of %s: %s", step, local.directory, why)
            continue
        mine.append(step)
    rows = _gather(mine)
    common = set(rows[0]).intersection(*rows[1:])
    if not common:
        if any(rows):
            newest = max(max(row) for row in rows if row)
            lacking = [str(i) for i, row in enumerate(rows) if newest not in row]
            log.info(
                "local tier: step %d is not complete on process %s (its local directory lost "
                "or its save cut short); restoring from the persistent tier",
                newest, ", ".join(lacking),
            )  # fmt: skip
        return None
    for step in sorted(common, reverse=True):  # a step that fails to read: the one before
        try:
            state, failed = local.restore(step, target), []
        except (OSError, ValueError) as exc:
            log.warning("local tier: step %d of %s cannot be read: %s", step, local.directory,
                        first_line(exc))  # fmt: skip
            state, failed = None, [jax.process_index()]
        if not any(_gather(failed)):
            log.info("resumed from step %d of the local tier %s", step, local.directory)
            return step, state
        log.info("local tier: step %d did not read on every process", step)
    log.info("local tier: no newer step reads on every process; restoring from the persistent "
             "tier")  # fmt: skip
    return None


def discard_newer_local(checkpointer: Any, step: int) -> None:
    """Deletes this process's local steps after `step`: a history this run recomputes."""
    local = checkpointer.local
    if local is None:
        return
    for newer in local.complete_steps():
        if newer > step:
            local.delete(newer)
