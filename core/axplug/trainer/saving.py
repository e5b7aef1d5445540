"""The training loop's checkpoint saves: a persistent save under `on_save_error`, and the save
of the step a preemption stops at."""

from __future__ import annotations

import logging
from typing import Any

from axplug.checkpoint import FROZEN_KEY, CheckpointError, prune
from axplug.config import strip_userinfo_tree, to_dict
from axplug.runtime import Preempted
from axplug.trainer.input_state import INPUT_STATE_KEY, gather_input_state

__all__ = ["SAVE_ERROR_POLICIES", "save_checkpoint", "save_and_stop"]

log = logging.getLogger("axplug.trainer")

SAVE_ERROR_POLICIES = ("stop", "retry_next")


def save_checkpoint(trainer: Any, state: dict, step: int) -> None:
    """Saves `step` (in the background); a failed save raises, or with `retry_next` is logged."""
    checkpointer = trainer.checkpointer
    try:  # a failed background write of the previous checkpoint surfaces here
        checkpointer.wait_until_finished()
    except CheckpointError as exc:
        _save_failed(trainer, exc)
    try:
        config = strip_userinfo_tree(to_dict(trainer.config))  # no credentials in metadata
        metadata = {"step": step, "config": config}
        if (states := gather_input_state(trainer, step)) is not None:
            metadata[INPUT_STATE_KEY] = states
        if trainer.frozen_source is not None:  # the base's weights stay in the base run
            state = {**state, "params": prune(trainer.stored_mask, state["params"])}
            metadata[FROZEN_KEY] = trainer.frozen_source
        checkpointer.save(step, state, metadata)
    except CheckpointError as exc:
        _save_failed(trainer, exc)
        return
    trainer.hooks(
        "on_checkpoint_saved",
        trainer=trainer,
        step=step,
        path=f"{checkpointer.directory}/step_{step:08d}",
    )


def _save_failed(trainer: Any, exc: CheckpointError) -> None:
    if trainer.config.on_save_error != "retry_next":
        raise exc
    log.error("%s; training continues, the next checkpoint saves again", exc)


def save_and_stop(trainer: Any, state: dict, step: int, signal_name: str | None) -> None:
    """Saves `step` (unless the loop just did) and waits for it, then raises `Preempted`."""
    with trainer.goodput.phase("checkpoint"):
        if step % trainer.config.checkpoint_every != 0:
            save_checkpoint(trainer, state, step)
        trainer.checkpointer.wait_until_finished()
    raise Preempted(step, signal_name or "a signal to another process")
