"""axplug-optimizers' `axplug.schedules` entries: the learning rate after warmup.

Each is called with the step counted from the end of warmup, starts at `peak` and runs for
`steps` steps (the contract: `axplug.api.run.ScheduleFactory`); a decaying one ends at
`peak * learner.end_learning_rate_fraction` and stays there.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

import jax.numpy as jnp
import optax

if TYPE_CHECKING:
    from axplug.learner import Learner

__all__ = ["wsd", "inverse_sqrt", "cosine_restarts"]


def wsd(
    peak: float,
    steps: int,
    cfg: Learner.Config,
    *,
    decay_fraction: float = 0.2,
    shape: Literal["linear", "cosine", "sqrt"] = "linear",
) -> optax.Schedule:
    """Warmup-stable-decay: the peak, then a decay over the last `decay_fraction` of the steps.

    The decay (`round(steps * decay_fraction)` steps, at least 1) goes from the peak to
    `end_learning_rate_fraction` of it: `shape` linear (1 - p), cosine ((1 + cos(pi p)) / 2)
    or sqrt (1 - sqrt(p)), p the fraction of the decay done.
    """
    if not 0 < decay_fraction <= 1:
        raise cfg.field_error(
            "schedule", f"wsd: decay_fraction must be in (0, 1], got {decay_fraction!r}"
        )
    if shape not in ("linear", "cosine", "sqrt"):
        raise cfg.field_error(
            "schedule", f"wsd: shape must be one of 'linear', 'cosine', 'sqrt', got {shape!r}"
        )
    decay = max(1, min(steps, round(steps * decay_fraction)))
    stable = steps - decay
    end = peak * cfg.end_learning_rate_fraction

    def schedule(step):
        p = jnp.clip((step - stable) / decay, 0.0, 1.0)
        if shape == "linear":
            left = 1.0 - p
        elif shape == "cosine":
            left = 0.5 * (1.0 + jnp.cos(jnp.pi * p))
        else:
            left = 1.0 - jnp.sqrt(p)
        return end + (peak - end) * left

    return schedule


def inverse_sqrt(
    peak: float, steps: int, cfg: Learner.Config, *, timescale: int | None = None
) -> optax.Schedule:
    """`peak * sqrt(timescale / (step + timescale))`: the inverse square root decay.

    Continuous with a warmup of `timescale` steps (the classic `peak * sqrt(warmup / t)`);
    `timescale` defaults to `learner.warmup_steps`. It never ends: `steps` and
    `end_learning_rate_fraction` do not apply.
    """
    if timescale is None:
        timescale = cfg.warmup_steps
        if timescale < 1:
            raise cfg.field_error(
                "schedule",
                "inverse_sqrt: needs a timescale; set learner.warmup_steps > 0 or "
                "inverse_sqrt:timescale=N",
            )
    elif timescale < 1:
        raise cfg.field_error("schedule", f"inverse_sqrt: timescale must be >= 1, got {timescale}")

    def schedule(step):
        return peak * jnp.sqrt(timescale / (jnp.maximum(step, 0) + timescale))

    return schedule


def cosine_restarts(
    peak: float,
    steps: int,
    cfg: Learner.Config,
    *,
    cycles: int = 4,
    peak_decay: float = 1.0,
) -> optax.Schedule:
    """Cosine decay restarted `cycles` times over the steps (SGDR, equal cycles).

    Cycle i (from 0) starts at `peak * peak_decay**i` and decays by cosine to
    `end_learning_rate_fraction` of that over `steps / cycles` steps (cycle boundaries at
    `round(i * steps / cycles)`); after the last cycle the rate stays at its end.
    """
    if cycles < 1 or cycles > steps:
        raise cfg.field_error(
            "schedule",
            f"cosine_restarts: cycles must be in [1, {steps}] (the steps after warmup), "
            f"got {cycles}",
        )
    if peak_decay <= 0:
        raise cfg.field_error(
            "schedule", f"cosine_restarts: peak_decay must be > 0, got {peak_decay}"
        )
    bounds = [round(i * steps / cycles) for i in range(cycles + 1)]
    alpha = cfg.end_learning_rate_fraction
    pieces = [
        optax.cosine_decay_schedule(peak * peak_decay**i, bounds[i + 1] - bounds[i], alpha=alpha)
        for i in range(cycles)
    ]
    return optax.join_schedules(pieces, bounds[1:-1])
