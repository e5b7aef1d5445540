"""The training loop's checkpoint saves: a persistent save under `on_save_error`, and the save
of the step a preemption stops at."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from axplug.checkpoint import FROZEN_KEY, CheckpointError, prune
from axplug.config import strip_userinfo_tree, to_dict
from axplug.runtime import GoodputRecorder, Preempted
from axplug.trainer.input_state import INPUT_STATE_KEY, gather_input_state
from axplug.trainer.restore import Restorer

__all__ = ["SAVE_ERROR_POLICIES", "Saver"]

log = logging.getLogger("axplug.trainer")

SAVE_ERROR_POLICIES = ("stop", "retry_next")


class Saver:
    """Saves a run's steps with `checkpointer`: the trainer `config` in each step's metadata
    (and its on_save_error, checkpoint_every), the `source` input's state, a fine-tune's trained
    parameters only (the `restorer` knows its base); `on_saved(step, path)` after each save."""

    def __init__(self, config: Any, checkpointer: Any, source: Any, restorer: Restorer,
                 goodput: GoodputRecorder, on_saved: Callable[[int, str], None]):  # fmt: skip
        self.config, self.checkpointer, self.source = config, checkpointer, source
        self.restorer, self.goodput, self.on_saved = restorer, goodput, on_saved

    def save(self, state: dict, step: int) -> None:
        """Saves `step` (in the background); a failed save raises, or with `retry_next` is
        logged."""
        checkpointer = self.checkpointer
        try:  # a failed background write of the previous checkpoint surfaces here
            checkpointer.wait_until_finished()
        except CheckpointError as exc:
            self._failed(exc)
        try:
            config = strip_userinfo_tree(to_dict(self.config))  # no credentials in metadata
            metadata = {"step": step, "config": config}
            if (states := gather_input_state(self.source, step)) is not None:
                metadata[INPUT_STATE_KEY] = states
            if (frozen := self.restorer.frozen_source) is not None:  # the base's stay there
                stored = self.restorer.layout.stored_mask
                state = {**state, "params": prune(stored, state["params"])}
                metadata[FROZEN_KEY] = frozen
            checkpointer.save(step, state, metadata)
        except CheckpointError as exc:
            self._failed(exc)
            return
        self.on_saved(step, f"{checkpointer.directory}/step_{step:08d}")

    def _failed(self, exc: CheckpointError) -> None:
        if self.config.on_save_error != "retry_next":
            raise exc
        log.error("%s; training continues, the next checkpoint saves again", exc)

    def save_and_stop(self, state: dict, step: int, signal_name: str | None) -> None:
        """Saves `step` (unless the loop just did) and waits for it, then raises `Preempted`."""
        with self.goodput.phase("checkpoint"):
            if step % self.config.checkpoint_every != 0:
                self.save(state, step)
            self.checkpointer.wait_until_finished()
        raise Preempted(step, signal_name or "a signal to another process")
