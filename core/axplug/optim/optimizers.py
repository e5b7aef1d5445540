"""The core's `axplug.optimizers` entries: optax optimizers configured by `Learner.Config`
(a first-party plugin has adafactor, lion, muon and lamb).

Each reads the learner's shared fields (`b1`, `b2`, `eps`, `weight_decay`, `momentum`) and
takes its own extras as options (`sgd:nesterov=True`). Those with decoupled weight decay apply
`learner.weight_decay` under `weight_decay_mask` (no decay for parameters whose
`ParameterSpec.weight_decay_scale` is 0: norms, biases).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import optax

if TYPE_CHECKING:
    from axplug.learner import Learner

__all__ = ["adamw", "adam", "sgd"]


def adamw(
    learning_rate: optax.Schedule,
    cfg: Learner.Config,
    *,
    weight_decay_mask: Any = None,
    mu_dtype: str | None = None,
) -> optax.GradientTransformation:
    """AdamW: Adam with decoupled weight decay (`b1`, `b2`, `eps`, `weight_decay`).

    `mu_dtype` stores the first moment in that dtype (`adamw:mu_dtype=bfloat16`).
    """
    return optax.adamw(
        learning_rate,
        b1=cfg.b1,
        b2=cfg.b2,
        eps=cfg.eps,
        mu_dtype=mu_dtype,
        weight_decay=cfg.weight_decay,
        mask=weight_decay_mask,
    )


def adam(
    learning_rate: optax.Schedule, cfg: Learner.Config, *, mu_dtype: str | None = None
) -> optax.GradientTransformation:
    """Adam without weight decay (`b1`, `b2`, `eps`; `learner.weight_decay` does not apply)."""
    return optax.adam(learning_rate, b1=cfg.b1, b2=cfg.b2, eps=cfg.eps, mu_dtype=mu_dtype)


def sgd(
    learning_rate: optax.Schedule,
    cfg: Learner.Config,
    *,
    weight_decay_mask: Any = None,
    nesterov: bool = False,
) -> optax.GradientTransformation:
    """SGD with `momentum` (0: none), decoupled `weight_decay`, and `nesterov` momentum."""
    if nesterov and not cfg.momentum:
        raise cfg.field_error(
            "optimizer", "sgd:nesterov=True needs momentum: set learner.momentum > 0"
        )
    return optax.chain(
        optax.add_decayed_weights(cfg.weight_decay, weight_decay_mask),
        optax.sgd(learning_rate, momentum=cfg.momentum or None, nesterov=nesterov),
    )
