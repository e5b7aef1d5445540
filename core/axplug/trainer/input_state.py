"""The input's own state (`Input.state_at`) in checkpoints: each process's, gathered into the
step's metadata as `input_state`, and handed back to the input on resume."""

from __future__ import annotations

import json
import logging
from typing import Any

import jax
import numpy as np

from axplug.checkpoint import CheckpointError

__all__ = ["INPUT_STATE_KEY", "gather_input_state", "restore_input_state"]

INPUT_STATE_KEY = "input_state"  # metadata: a list with each process's state, in process order
log = logging.getLogger("axplug.trainer")


def _allgather_json(value: Any) -> list:
    """`value` of every process, in process order (one process: no collective)."""
    if jax.process_count() == 1:
        return [value]
    from jax.experimental import multihost_utils

    data = np.frombuffer(json.dumps(value).encode(), np.uint8)
    sizes = multihost_utils.process_allgather(np.int64(len(data)))
    padded = np.zeros(int(np.max(sizes)), np.uint8)
    padded[: len(data)] = data
    rows = multihost_utils.process_allgather(padded)
    return [json.loads(bytes(row[:n])) for row, n in zip(rows, sizes, strict=True)]


def gather_input_state(source: Any, step: int) -> list | None:
    """Every process's `source.state_at(step)`; None when the input keeps no state."""
    states = _allgather_json(source.state_at(step))
    return None if all(s is None for s in states) else states


def restore_input_state(source: Any, step: int, metadata: dict | None, where: str) -> None:
    """Hands this process's saved input state of `step` (of the checkpoints in `where`) to
    `source` (the input), when there is one."""
    states = (metadata or {}).get(INPUT_STATE_KEY)
    if states is None:
        if step > 0 and source.state_at(step) is not None:
            log.warning(
                "step %d was saved without the input's state (a local-tier or older "
                "checkpoint): the input restarts its stream at step %d its own way",
                step,
                step,
            )
        return
    if len(states) != jax.process_count():
        raise CheckpointError(
            f"step {step} of {where} holds the input state of "
            f"{len(states)} process(es), this run has {jax.process_count()}: the input's "
            "stream cannot be split again; resume with the same number of processes"
        )
    mine = states[jax.process_index()]
    if mine is not None:
        source.restore_state(step, mine)
