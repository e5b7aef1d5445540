"""The training loop's checkpoint saves: a persistent save under `saving.on_error`, and the save
of the step a preemption stops at."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from axplug.checkpoint import FROZEN_KEY, CheckpointError, prune, step_dir_name
from axplug.config import ConfigBase, config_class, strip_userinfo_tree, to_dict
from axplug.runtime import GoodputRecorder, Preempted
from axplug.trainer.input_state import INPUT_STATE_KEY, gather_input_state
from axplug.trainer.restore import Restorer

__all__ = ["SAVE_ERROR_POLICIES", "Saver"]

log = logging.getLogger("axplug.trainer")

SAVE_ERROR_POLICIES = ("stop", "retry_next")


class Saver:
    """Saves a run's steps with `checkpointer`: the trainer `config` in each step's metadata
    (and its `saving`), the `source` input's state, a fine-tune's trained parameters only (the
    `restorer` knows its base); `on_saved(step, path)` after each save."""

    @config_class
    class Config(ConfigBase):
        # A failed checkpoint save: "stop" raises; "retry_next" logs it, trains on and saves
        # again at the next checkpoint step (a failed last save of the run always raises).
        on_error: str = "stop"

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
        self.on_saved(step, f"{checkpointer.directory}/{step_dir_name(step)}")

    def _failed(self, exc: CheckpointError) -> None:
        if self.config.saving.on_error != "retry_next":
            raise exc
        log.error("%s; training continues, the next checkpoint saves again", exc)

    def save_and_stop(self, state: dict, step: int, signal_name: str | None) -> None:
        """Saves `step` (unless the loop just did) and waits for it, then raises `Preempted`."""
        with self.goodput.phase("checkpoint"):
            if step % self.config.checkpoint_every != 0:
                self.save(state, step)
            self.checkpointer.wait_until_finished()
        raise Preempted(step, signal_name or "a signal to another process")
