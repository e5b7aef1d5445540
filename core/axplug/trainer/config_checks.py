"""What a trainer config can be checked for without building or writing anything: a run and
`axplug train --print-config` refuse alike, and a refused run leaves no files."""

from __future__ import annotations

from typing import Any

from axplug.checkpoint import Checkpointer
from axplug.checkpoint.retention import check_retention
from axplug.config import configurable_class
from axplug.input import Input
from axplug.learner import Learner
from axplug.trainer.profiling import check_profile_steps
from axplug.trainer.saving import SAVE_ERROR_POLICIES
from axplug.trainer.step import GUARDS

__all__ = ["check_trainer_config", "CORRUPT_POLICIES"]

CORRUPT_POLICIES = ("previous", "stop")


def check_trainer_config(cfg: Any) -> None:
    """Raises the ConfigError a run would: the trainer's fields, the learner's choices, the
    checkpointer's retention, each summary writer's and evaluator's `check_config`."""
    for sub, name, choices in (
        (cfg.saving, "on_error", SAVE_ERROR_POLICIES),
        (cfg.restore, "on_corrupt", CORRUPT_POLICIES),
        (cfg.guard, "mode", ("auto", *GUARDS)),
    ):
        if getattr(sub, name) not in choices:
            raise sub.field_error(name, f"must be one of {choices}, got {getattr(sub, name)!r}")
    if cfg.guard.max_steps < 1:
        raise cfg.guard.field_error("max_steps", f"must be >= 1, got {cfg.guard.max_steps}")
    for name in ("max_steps", "checkpoint_every", "log_every", "eval_batches"):
        if getattr(cfg, name) < 1:
            raise cfg.field_error(name, f"must be >= 1, got {getattr(cfg, name)}")
    if cfg.eval_every is not None and cfg.eval_every < 1:
        raise cfg.field_error("eval_every", f"must be >= 1 or None, got {cfg.eval_every}")
    check_profile_steps(cfg)
    for field in ("input", "eval_input"):  # the trainer calls every method of Input
        klass = getattr(cfg, field).klass if getattr(cfg, field) is not None else Input
        if not (isinstance(klass, type) and issubclass(klass, Input)):
            raise cfg.field_error(field, f"{klass!r} is not a subclass of axplug.input.Input")
    if isinstance(cfg.learner, Learner.Config):
        Learner.check_config(cfg.learner, cfg.max_steps)
    if isinstance(cfg.checkpointer, Checkpointer.Config):
        check_retention(cfg.checkpointer)
    # Before any writer is built: an earlier one (metrics.jsonl) would leave files behind.
    for field in ("summary_writers", "evaluators"):
        for i, part in enumerate(getattr(cfg, field)):
            if (klass := configurable_class(part)) is not None:
                klass.check_config(part.located(f"{field}[{i}]"))
