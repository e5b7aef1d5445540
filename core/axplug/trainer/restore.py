"""Where a run starts: the newest step of the local tier complete on every process when it is
newer than the persistent tier's (`local_restore`), else the latest persistent checkpoint that
restores and verifies, else fresh weights (or the `init_from` run's), falling back past
corrupt steps."""

from __future__ import annotations

import logging
import os
from typing import Any

import jax
import jax.numpy as jnp

from axplug.checkpoint import CheckpointCorruptError, checkpoint_directory
from axplug.trainer.fresh_optimizer import fresh_opt_state, restore_train_state
from axplug.trainer.init_from import restore_weights
from axplug.trainer.local_restore import discard_newer_local, restore_newer_local

__all__ = ["restore_or_init"]

log = logging.getLogger("axplug.trainer")


def _absolute(directory: str) -> str:
    """A local directory as an absolute path (a URL as it is): resumable from any cwd."""
    return directory if "://" in directory else os.path.abspath(directory)


def _merged(fresh: Any, restored: Any) -> Any:
    """`fresh` with every leaf `restored` holds replaced by it."""
    if not isinstance(fresh, dict):
        return restored
    return {k: _merged(v, restored[k]) if k in restored else v for k, v in fresh.items()}


def _init_from(trainer: Any, fresh: dict) -> dict:
    cfg = trainer.config
    # Under learner.trainable, trained parameters the source lacks (adapters) start fresh.
    new_ok = None if cfg.init_optimizer else trainer.optimizer_mask
    step, params, opt_state = restore_weights(
        cfg.init_from,
        cfg.init_step,
        abstract_state=trainer.abstract_state,
        optimizer=cfg.init_optimizer,
        new_ok=new_ok,
    )
    log.info("starting from the weights of step %d of %s", step, cfg.init_from)
    if trainer.frozen_mask is not None:  # checkpoints store the trained parameters only
        trainer.frozen_source = {"from": _absolute(checkpoint_directory(cfg.init_from)),
                                 "step": step}  # fmt: skip
    # step 0: the fine-tune's own count and schedule
    state = {**fresh, "params": _merged(fresh["params"], params)}
    if cfg.init_optimizer:  # the source's, or (it holds none: an import) what it would hold
        state["opt_state"] = (
            opt_state if opt_state is not None else fresh_opt_state(trainer, params)
        )
    return state


def _from_source(trainer: Any) -> dict:
    """The state of a fine-tune whose parameters all come from `init_from`: restored onto
    this run's layout with no random initialization first (which cost a compile of every
    initializer), and the source's optimizer state or a fresh one."""
    cfg = trainer.config
    step, params, opt_state = restore_weights(
        cfg.init_from, cfg.init_step, abstract_state=trainer.abstract_state,
        optimizer=cfg.init_optimizer,
    )  # fmt: skip
    log.info("starting from the weights of step %d of %s", step, cfg.init_from)
    if opt_state is None:  # not asked for, or the source holds none (an import)
        opt_state = fresh_opt_state(trainer, params)
    zero = jax.device_put(jnp.zeros((), jnp.int32), trainer.state_shardings["step"])
    return {"params": params, "opt_state": opt_state, "step": zero}


def restore_or_init(trainer: Any) -> dict:
    """The newest step either tier holds complete (on every process), else a fresh state.

    Local steps after the one restored are deleted: training recomputes them.
    """
    newer = None
    if trainer.checkpointer.local is not None:
        with trainer.goodput.phase("restore"):
            newer = restore_newer_local(trainer)
    state = newer[1] if newer is not None else _persistent_or_init(trainer)
    discard_newer_local(trainer, int(jax.device_get(state["step"])))
    return state


def _persistent_or_init(trainer: Any) -> dict:
    """The latest complete checkpoint that restores and verifies, else a fresh state.

    A step that fails (a truncated or changed file, unreadable metadata) is reported; with
    `on_corrupt_checkpoint="previous"` it is marked incomplete (replaced when training
    reaches it again) and the step before is tried.
    """
    steps = trainer.checkpointer.all_steps()
    if not steps and trainer.config.init_from is not None and trainer.optimizer_mask is None:
        with trainer.goodput.phase("restore"):  # every parameter comes from the source
            return _from_source(trainer)
    if not steps:
        log.info("initializing parameters and optimizer state")
        with trainer.goodput.phase("init"):
            state = trainer.init_state()
        if trainer.config.init_from is not None:
            with trainer.goodput.phase("restore"):
                state = _init_from(trainer, state)
        return state
    for step in reversed(steps):
        log.info("restoring step %d", step)
        try:
            with trainer.goodput.phase("restore"):
                step, state, trainer.restored_metadata = restore_train_state(trainer, step)
        except CheckpointCorruptError as exc:
            if trainer.config.on_corrupt_checkpoint == "stop":
                raise
            log.warning("%s; marking it incomplete and trying the step before", exc)
            trainer.checkpointer.uncommit(step)
            continue
        log.info("resumed from step %d of %s", step, trainer.checkpointer.directory)
        return state
    raise CheckpointCorruptError(
        f"no complete step of {trainer.checkpointer.directory} restores (tried "
        f"{', '.join(map(str, reversed(steps)))}); they are marked incomplete. Move the "
        "directory aside to start over, or restore a copy"
    )
