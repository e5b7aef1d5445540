"""Optimizers and learning-rate schedules as components: the `axplug.optimizers` and
`axplug.schedules` entry-point groups.

`learner.optimizer` and `learner.schedule` name one entry each, with options:
`NAME[:key=value,...]` (`adam`, `sgd:nesterov=True`, `adamw:mu_dtype=bfloat16`). The core
registers adamw, adam, sgd and constant, cosine, linear; a first-party plugin adds more.
The options are the factory's keyword parameters; `Learner.check_config` resolves the name,
checks the options against the factory's signature and builds both once, so a bad spec is
one `ConfigError` naming the field before anything runs.

An `axplug.optimizers` entry (`OptimizerFactory`) is called as

    make(learning_rate, cfg, *, weight_decay_mask=..., **options) -> optax.GradientTransformation

`learning_rate` is the whole schedule (warmup included; an `optax.Schedule`), `cfg` the
`Learner.Config` (read `b1`, `b2`, `eps`, `weight_decay`, `momentum` from it: one knob per
hyperparameter for every optimizer). The result scales by the learning rate itself. A
factory with decoupled weight decay takes the keyword `weight_decay_mask` (a pytree of bools
shaped like the trained parameters, True where `ParameterSpec.weight_decay_scale > 0`, or
None: decay everything) and applies `cfg.weight_decay` under it; a factory without the
parameter is not given it. Gradient clipping (`max_grad_norm`) and accumulation stay in the
Learner, around the result.

An `axplug.schedules` entry (`ScheduleFactory`) is called as

    make(peak, steps, cfg, **options) -> optax.Schedule

for the part after warmup: it is called with the step counted from the end of warmup
(`learner.warmup_steps`, a linear ramp from 0 that the Learner adds to every schedule) and
should start at `peak` (`learner.learning_rate`). `steps` is how long it runs:
`learner.decay_steps` (or the run's `max_steps`) minus `warmup_steps`, at least 1. A decaying
schedule ends at `peak * cfg.end_learning_rate_fraction` and stays there.

Either raises `cfg.field_error("optimizer" | "schedule", "what is wrong; the fix")` for an
option value it refuses (a `ValueError` or `TypeError` it raises is reported the same way).
"""

from axplug.optim.contract import OptimizerFactory, ScheduleFactory
from axplug.optim.spec import (
    CORE_OPTIMIZERS,
    CORE_SCHEDULES,
    ComponentSpec,
    build_optimizer,
    build_schedule,
    resolve,
)

__all__ = [
    "OptimizerFactory",
    "ScheduleFactory",
    "CORE_OPTIMIZERS",
    "CORE_SCHEDULES",
    "ComponentSpec",
    "resolve",
    "build_optimizer",
    "build_schedule",
]
