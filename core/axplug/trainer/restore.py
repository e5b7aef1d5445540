"""Where a run starts: the newest step of the local tier complete on every process when it is
newer than the persistent tier's (`local_restore`), else the latest persistent checkpoint that
restores and verifies, else fresh weights (or the `init_from` run's), falling back past
corrupt steps."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from axplug.checkpoint import (
    FROZEN_KEY,
    CheckpointCorruptError,
    Checkpointer,
    checkpoint_directory,
    params_digest,
)
from axplug.config import ConfigBase, config_class
from axplug.runtime import GoodputRecorder
from axplug.trainer.fresh_optimizer import restore_train_state
from axplug.trainer.init_from import restore_weights
from axplug.trainer.layout import StateLayout
from axplug.trainer.local_restore import discard_newer_local, restore_newer_local

__all__ = ["Restorer"]

log = logging.getLogger("axplug.trainer")


def _absolute(directory: str) -> str:
    """A local directory as an absolute path (a URL as it is): resumable from any cwd."""
    return directory if "://" in directory else os.path.abspath(directory)


def _merged(fresh: Any, restored: Any) -> Any:
    """`fresh` with every leaf `restored` holds replaced by it."""
    if not isinstance(fresh, dict):
        return restored
    return {k: _merged(v, restored[k]) if k in restored else v for k, v in fresh.items()}


class Restorer:
    """A run's starting state from its `checkpointer` (either tier), else from `init_state`
    (fresh parameters) or the `init_from` run's weights, laid out as `layout`; `config` is the
    trainer's `restore` (a `Restorer.Config`).

    After `restore_or_init`: `metadata` of the persistent step resumed from (else None), and
    `frozen_source`, the base run a fine-tune's frozen parameters come from (else None), which
    its saves record."""

    @config_class
    class Config(ConfigBase):
        # Fine-tuning: a run (or import) directory whose weights start this run while it has
        # no checkpoint of its own; its latest step unless `init_step`. The optimizer state
        # starts fresh unless `init_optimizer` (then the learner must be the same).
        init_from: str | None = None
        init_step: int | None = None
        init_optimizer: bool = False
        # A latest checkpoint that fails to restore or verify: "previous" warns, marks it
        # incomplete and resumes from the step before; "stop" raises.
        on_corrupt: str = "previous"

    def __init__(self, config: Config, checkpointer: Any, layout: StateLayout,
                 goodput: GoodputRecorder, init_state: Callable[[], dict]):  # fmt: skip
        self.config, self.checkpointer, self.layout = config, checkpointer, layout
        self.goodput, self.init_state = goodput, init_state
        self.metadata: dict | None = None
        self.frozen_source: dict | None = None

    def restore_or_init(self) -> dict:
        """The newest step either tier holds complete (on every process), else a fresh state.

        Local steps after the one restored are deleted: training recomputes them.
        """
        newer = None
        if self.checkpointer.local is not None:
            with self.goodput.phase("restore"):
                newer = restore_newer_local(self.checkpointer, self.layout.abstract)
        state = newer[1] if newer is not None else self._persistent_or_init()
        discard_newer_local(self.checkpointer, int(jax.device_get(state["step"])))
        return state

    def _persistent_or_init(self) -> dict:
        """The latest complete checkpoint that restores and verifies, else a fresh state.

        A step that fails (a truncated or changed file, unreadable metadata) is reported; with
        `restore.on_corrupt="previous"` it is marked incomplete (replaced when training
        reaches it again) and the step before is tried.
        """
        cfg, checkpointer, goodput = self.config, self.checkpointer, self.goodput
        steps = checkpointer.all_steps()
        if not steps and cfg.init_from is not None and self.layout.optimizer_mask is None:
            with goodput.phase("restore"):  # every parameter comes from the source
                return self._init_from()
        if not steps:
            log.info("initializing parameters and optimizer state")
            with goodput.phase("init"):
                state = self.init_state()
            if cfg.init_from is not None:
                with goodput.phase("restore"):
                    state = self._init_from(state)
            return state
        for step in reversed(steps):
            log.info("restoring step %d", step)
            try:
                with goodput.phase("restore"):
                    step, state, metadata = restore_train_state(checkpointer, self.layout, step)
            except CheckpointCorruptError as exc:
                if cfg.on_corrupt == "stop":
                    raise
                log.warning("%s; marking it incomplete and trying the step before", exc)
                checkpointer.uncommit(step)
                continue
            self.metadata, self.frozen_source = metadata, metadata.get(FROZEN_KEY)
            log.info("resumed from step %d of %s", step, checkpointer.directory)
            return state
        raise CheckpointCorruptError(
            f"no complete step of {checkpointer.directory} restores (tried "
            f"{', '.join(map(str, reversed(steps)))}); they are marked incomplete. Move the "
            "directory aside to start over, or restore a copy"
        )

    def _init_from(self, fresh: dict | None = None) -> dict:
        """A fine-tune's state from `init_from`'s weights, over `fresh` (a random init, for the
        trained parameters the source lacks under learner.trainable) or, with None, restored
        straight onto this run's layout (no initializer compiled); the source's optimizer state
        when `init_optimizer` (a fresh one when it holds none: an import)."""
        cfg, layout = self.config, self.layout
        assert cfg.init_from is not None  # called for a run that has one
        new_ok = None if cfg.init_optimizer else layout.optimizer_mask
        step, params, opt_state = restore_weights(
            cfg.init_from,
            cfg.init_step,
            abstract_state=layout.abstract,
            optimizer=cfg.init_optimizer,
            new_ok=new_ok,
        )
        log.info("starting from the weights of step %d of %s", step, cfg.init_from)
        if opt_state is None and (cfg.init_optimizer or fresh is None):
            opt_state = layout.fresh_opt_state(params)
        if fresh is None:  # step 0: the fine-tune's own count and schedule
            zero = jax.device_put(jnp.zeros((), jnp.int32), layout.shardings["step"])
            return {"params": params, "opt_state": opt_state, "step": zero}
        if layout.frozen_mask is not None:  # checkpoints store the trained parameters only
            base = _absolute(checkpoint_directory(cfg.init_from))
            with Checkpointer.default_config().set(directory=base).instantiate() as source:
                digest = params_digest(source, step)  # the base these parameters are trained on
            self.frozen_source = {"from": base, "step": step, "digest": digest}
        state = {**fresh, "params": _merged(fresh["params"], params)}
        if cfg.init_optimizer:
            state["opt_state"] = opt_state
        return state
