"""The learner: an optax optimizer, schedule, clipping and weight-decay mask chosen by config.

The optimizer and the schedule are components (`axplug.optimizers`, `axplug.schedules`; see
axplug.optim): `learner.optimizer` and `learner.schedule` name one each, `NAME[:key=value,...]`.
"""

from __future__ import annotations

import re
from typing import Any

import jax
import optax

from axplug.api import ParameterSpec
from axplug.config import ConfigError, Configurable, config_class
from axplug.optim import CORE_OPTIMIZERS, CORE_SCHEDULES, build_optimizer, build_schedule

__all__ = ["Learner", "OPTIMIZERS", "SCHEDULES", "clip_by_global_norm"]

# The core's own names; plugins add more (`axplug list --kind optimizers`, `--kind schedules`).
OPTIMIZERS = CORE_OPTIMIZERS
SCHEDULES = CORE_SCHEDULES
# The run length `check_config` builds the schedule for when it is not given one: long, so
# that a check of the steps (a plugin's `cosine_restarts:cycles=N`) refuses nothing a real run
# takes.
_CHECK_STEPS = 1_000_000


def clip_by_global_norm(max_norm: float) -> optax.GradientTransformationExtraArgs:
    """optax.clip_by_global_norm that takes an already computed norm as `grad_norm=`.

    The train step needs the norm anyway (its non-finite guard), and XLA cannot share a norm
    computed inside the optimizer with one outside it: passing it saves a pass over every
    gradient. Its state is optax's (empty), so checkpoints are unchanged.
    """
    base = optax.clip_by_global_norm(max_norm)

    def update(updates, state, params=None, *, grad_norm=None, **extra_args):
        del params, extra_args
        if grad_norm is None:
            grad_norm = optax.tree_utils.tree_norm(updates)
        trigger = jax.numpy.squeeze(grad_norm < max_norm)
        # optax's own arithmetic (a scalar select), so results match it bit for bit.
        clipped = jax.tree.map(
            lambda t: jax.lax.select(trigger, t, (t / grad_norm.astype(t.dtype)) * max_norm),
            updates,
        )
        return clipped, state

    return optax.GradientTransformationExtraArgs(base.init, update)


class Learner(Configurable):
    """Builds the optax transformation that turns gradients into parameter updates."""

    @config_class
    class Config(Configurable.Config):
        # `NAME[:key=value,...]` of an `axplug.optimizers` entry: `adam`, `sgd:nesterov=True`.
        optimizer: str = "adamw"
        learning_rate: float = 3e-4
        # `NAME[:key=value,...]` of an `axplug.schedules` entry (after warmup):
        # `linear`, a plugin's `wsd:decay_fraction=0.1,shape=sqrt`.
        schedule: str = "cosine"
        warmup_steps: int = 0
        # Steps over which the schedule decays; None: the trainer's max_steps.
        decay_steps: int | None = None
        end_learning_rate_fraction: float = 0.1
        b1: float = 0.9
        b2: float = 0.95
        eps: float = 1e-8
        momentum: float = 0.9  # sgd only
        weight_decay: float = 0.1
        max_grad_norm: float | None = 1.0
        # Micro-batches per step: gradients are averaged over this many slices of the batch.
        grad_accumulation_steps: int = 1
        # A regex searched in each parameter's path (`decoder/transformer/layer0/attention/
        # q_proj/weight`): the parameters it does not match are frozen (no gradient, no
        # optimizer state, never changed). None: every parameter trains.
        trainable: str | None = None

    @classmethod
    def check_config(cls, cfg: Config, total_steps: int | None = None) -> None:
        """Raises the ConfigError naming a field whose value is not one this learner takes.

        The optimizer and schedule specs are resolved, their options checked against the
        factories' signatures, and both built once (for `total_steps`, when known)."""
        build_schedule(cfg, cfg.learning_rate, _decay_steps(cfg, total_steps or _CHECK_STEPS))
        build_optimizer(cfg, optax.constant_schedule(cfg.learning_rate), None)
        if cfg.grad_accumulation_steps < 1:
            raise ConfigError("learner.grad_accumulation_steps: must be >= 1")
        if cfg.trainable is not None:
            try:
                re.compile(cfg.trainable)
            except re.error as e:
                raise ConfigError(
                    f"learner.trainable: {cfg.trainable!r} is not a regular expression ({e})"
                ) from None

    def __init__(self, cfg: Config):
        super().__init__(cfg)
        self.check_config(cfg)

    @property
    def grad_accumulation_steps(self) -> int:
        return self._config.grad_accumulation_steps

    def schedule(self, total_steps: int) -> optax.Schedule:
        """Learning rate as a function of the step: linear warmup, then the configured decay."""
        cfg = self._config
        peak = cfg.learning_rate
        after = build_schedule(cfg, peak, _decay_steps(cfg, total_steps))
        if cfg.warmup_steps == 0:
            return after
        warmup = optax.linear_schedule(0.0, peak, cfg.warmup_steps)
        return optax.join_schedules([warmup, after], [cfg.warmup_steps])

    def transform(self, specs: Any, total_steps: int) -> optax.GradientTransformation:
        """The optax chain for parameters described by the ParameterSpec tree `specs`."""
        cfg = self._config
        lr = self.schedule(total_steps)
        # Parameters whose spec says weight_decay_scale == 0 (norms, biases) are not decayed:
        # the optimizer factory applies learner.weight_decay under this mask (axplug.optim).
        mask = jax.tree.map(
            lambda s: s.weight_decay_scale > 0,
            specs,
            is_leaf=lambda s: isinstance(s, ParameterSpec),
        )
        opt = build_optimizer(cfg, lr, mask)
        if cfg.max_grad_norm is None:
            return opt
        return optax.chain(clip_by_global_norm(cfg.max_grad_norm), opt)


def _decay_steps(cfg: Learner.Config, total_steps: int) -> int:
    """The steps the after-warmup schedule runs: `decay_steps` (or the run's) less warmup."""
    return max((cfg.decay_steps or total_steps) - cfg.warmup_steps, 1)
