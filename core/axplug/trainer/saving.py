"""The training loop's checkpoint saves: a persistent save under `saving.on_error`, and the save
of the step a preemption stops at."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from axplug.checkpoint import (
    FROZEN_KEY,
    CheckpointError,
    StoreOutageError,
    prune,
    step_dir_name,
)
from axplug.config import ConfigBase, config_class, strip_userinfo_tree, to_dict
from axplug.runtime import RESTART_EXIT_CODE, GoodputRecorder, Preempted
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

    def save(self, state: dict, step: int, *, wait: bool = False) -> None:
        """Saves `step` (in the background unless `wait`); a failed save raises, or with
        `retry_next` is logged; an unreachable store is retried (`_write`)."""
        checkpointer = self.checkpointer
        try:  # a failed background write of the previous checkpoint surfaces here
            checkpointer.wait_until_finished()
        except CheckpointError as exc:
            self._failed(exc)
        config = strip_userinfo_tree(to_dict(self.config))  # no credentials in metadata
        metadata = {"step": step, "config": config}
        if (states := gather_input_state(self.source, step)) is not None:
            metadata[INPUT_STATE_KEY] = states
        if (frozen := self.restorer.frozen_source) is not None:  # the base's stay there
            stored = self.restorer.layout.stored_mask
            state = {**state, "params": prune(stored, state["params"])}
            metadata[FROZEN_KEY] = frozen
        if self._write(step, state, metadata, wait=wait):
            self.on_saved(step, f"{checkpointer.directory}/{step_dir_name(step)}")

    def _write(self, step: int, state: dict, metadata: dict, *, wait: bool) -> bool:
        """Saves `step`; while the store does not answer, saves it again (waiting for each
        attempt) for up to the storage's `outage_s`, then raises StoreOutageError (exit 75)."""
        checkpointer, deadline, delay = self.checkpointer, None, 1.0
        storage = checkpointer.storage
        while True:
            try:
                checkpointer.save(step, state, metadata)
                if wait or deadline is not None:
                    checkpointer.wait_until_finished()
                return True
            except CheckpointError as exc:
                if not storage.is_outage(exc):
                    self._failed(exc)
                    return False
                now = time.monotonic()
                if deadline is None:
                    deadline = now + storage.outage_s
                    log.warning("%s; saving again for up to %g s", exc, storage.outage_s)
                if now + delay > deadline:
                    raise _outage(exc, storage.outage_s) from None
                time.sleep(delay)
                delay = min(2 * delay, 10.0)

    def finish(self) -> None:
        """Waits for the last background save; a store that does not answer ends the run
        with StoreOutageError (exit 75: the rerun resumes from the newest complete step)."""
        try:
            self.checkpointer.wait_until_finished()
        except CheckpointError as exc:
            if self.checkpointer.storage.is_outage(exc):
                raise _outage(exc, self.checkpointer.storage.outage_s) from None
            raise

    def _failed(self, exc: CheckpointError) -> None:
        outage = self.checkpointer.storage.is_outage(exc)  # this step's save rides it out
        if self.config.saving.on_error != "retry_next" and not outage:
            raise exc
        log.error("%s; training continues, the next checkpoint saves again", exc)

    def save_and_stop(self, state: dict, step: int, signal_name: str | None) -> None:
        """Saves `step` (unless the loop just did) and waits for it, then raises `Preempted`."""
        with self.goodput.phase("checkpoint"):
            if step % self.config.checkpoint_every != 0:
                self.save(state, step, wait=True)
            self.checkpointer.wait_until_finished()
        raise Preempted(step, signal_name or "a signal to another process")


def _outage(exc: CheckpointError, outage_s: float) -> StoreOutageError:
    return StoreOutageError(
        f"{exc}; no answer for {outage_s:g} s (storage option outage_s). Exit "
        f"{RESTART_EXIT_CODE}: the run's state is safe at its newest complete checkpoint; "
        "rerun the command to resume from it"
    )
