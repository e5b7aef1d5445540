"""The declared types of `axplug.optimizers` and `axplug.schedules` entries (see axplug.optim)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import optax

    from axplug.learner import Learner

__all__ = ["OptimizerFactory", "ScheduleFactory", "RESERVED"]

# Parameters the Learner fills itself; never options of a spec.
RESERVED = {"optimizers": ("weight_decay_mask",), "schedules": ()}


class OptimizerFactory(Protocol):
    """An `axplug.optimizers` entry: a function (not a class)."""

    def __call__(
        self,
        learning_rate: optax.Schedule,
        cfg: Learner.Config,
        /,
        *,
        weight_decay_mask: Any = None,
        **options: Any,
    ) -> optax.GradientTransformation:
        """The optimizer, scaling by `learning_rate`, with decoupled weight decay
        (`cfg.weight_decay`) under `weight_decay_mask` where it has any; `options` are the
        spec's `key=value` pairs, declared as keyword parameters with defaults."""
        ...


class ScheduleFactory(Protocol):
    """An `axplug.schedules` entry: a function (not a class)."""

    def __call__(
        self, peak: float, steps: int, cfg: Learner.Config, /, **options: Any
    ) -> optax.Schedule:
        """The learning rate after warmup as a function of the step since warmup ended:
        `peak` at 0, over `steps` steps (a decay ends at `peak *
        cfg.end_learning_rate_fraction`)."""
        ...
