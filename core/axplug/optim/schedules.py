"""The core's `axplug.schedules` entries: the learning rate after warmup (a first-party
plugin has wsd, inverse_sqrt and cosine_restarts).

Each is called with the step counted from the end of warmup, starts at `peak` and runs for
`steps` steps (axplug.optim); a decaying one ends at `peak * learner.end_learning_rate_fraction`
and stays there.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import optax

if TYPE_CHECKING:
    from axplug.learner import Learner

__all__ = ["constant", "cosine", "linear"]


def _end(peak: float, cfg: Learner.Config) -> float:
    return peak * cfg.end_learning_rate_fraction


def constant(peak: float, steps: int, cfg: Learner.Config) -> optax.Schedule:
    """The peak learning rate throughout."""
    return optax.constant_schedule(peak)


def cosine(peak: float, steps: int, cfg: Learner.Config) -> optax.Schedule:
    """Cosine decay from the peak to `end_learning_rate_fraction` of it over the steps."""
    return optax.cosine_decay_schedule(peak, steps, alpha=_end(peak, cfg) / peak if peak else 0)


def linear(peak: float, steps: int, cfg: Learner.Config) -> optax.Schedule:
    """Linear decay from the peak to `end_learning_rate_fraction` of it over the steps."""
    return optax.linear_schedule(peak, _end(peak, cfg), steps)
