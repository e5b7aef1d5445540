"""axplug-optimizers' `axplug.optimizers` entries: optax optimizers configured by
`Learner.Config`.

Each reads the learner's shared fields (`b1`, `b2`, `eps`, `weight_decay`) and takes its own
extras as options (`muon:ns_steps=3`). Those with decoupled weight decay apply
`learner.weight_decay` under `weight_decay_mask` (no decay for parameters whose
`ParameterSpec.weight_decay_scale` is 0: norms, biases).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import optax

from axplug.api.config import ConfigDependencyError

if TYPE_CHECKING:
    from axplug.learner import Learner

__all__ = ["adafactor", "lion", "muon", "lamb", "MUON_OPTAX"]

# The first optax release with `optax.contrib.muon` (and the arguments used below).
MUON_OPTAX = "0.2.5"


def adafactor(
    learning_rate: optax.Schedule,
    cfg: Learner.Config,
    *,
    weight_decay_mask: Any = None,
    decay_rate: float = 0.8,
    clipping_threshold: float | None = 1.0,
    momentum: float | None = None,
    factored: bool = True,
    multiply_by_parameter_scale: bool = True,
    min_dim_size_to_factor: int = 128,
) -> optax.GradientTransformation:
    """Adafactor: factored second moments, with `weight_decay` (options as in optax)."""
    return optax.adafactor(
        learning_rate,
        min_dim_size_to_factor=min_dim_size_to_factor,
        decay_rate=decay_rate,
        multiply_by_parameter_scale=multiply_by_parameter_scale,
        clipping_threshold=clipping_threshold,
        momentum=momentum,
        weight_decay_rate=cfg.weight_decay or None,
        factored=factored,
        weight_decay_mask=weight_decay_mask,
    )


def lion(
    learning_rate: optax.Schedule,
    cfg: Learner.Config,
    *,
    weight_decay_mask: Any = None,
    mu_dtype: str | None = None,
) -> optax.GradientTransformation:
    """Lion: the sign of interpolated momentum (`b1`, `b2`), decoupled `weight_decay`.

    It takes the learner's `b1`/`b2` (0.9/0.95 by default; the paper's 0.9/0.99 with
    `--set learner.b2=0.99`) and usually a 3-10x smaller learning rate than AdamW.
    """
    return optax.lion(
        learning_rate,
        b1=cfg.b1,
        b2=cfg.b2,
        mu_dtype=mu_dtype,
        weight_decay=cfg.weight_decay,
        mask=weight_decay_mask,
    )


def lamb(
    learning_rate: optax.Schedule, cfg: Learner.Config, *, weight_decay_mask: Any = None
) -> optax.GradientTransformation:
    """LAMB: Adam with layer-wise trust ratios (`b1`, `b2`, `eps`, `weight_decay`)."""
    return optax.lamb(
        learning_rate,
        b1=cfg.b1,
        b2=cfg.b2,
        eps=cfg.eps,
        weight_decay=cfg.weight_decay,
        mask=weight_decay_mask,
    )


def muon(
    learning_rate: optax.Schedule,
    cfg: Learner.Config,
    *,
    weight_decay_mask: Any = None,
    beta: float = 0.95,
    ns_steps: int = 5,
    nesterov: bool = True,
    adam_weight_decay: float = 0.0,
) -> optax.GradientTransformation:
    """Muon: orthogonalized momentum for 2-D weights, AdamW for every other parameter.

    optax.contrib.muon's split: parameters with exactly two dimensions get Muon (momentum
    `beta`, `ns_steps` Newton-Schulz steps, decoupled `weight_decay` under the mask); the others
    (norms, biases, and stacked weights of scanned layers, which are 3-D) get AdamW with the
    learner's `b1`, `b2`, `eps` and `adam_weight_decay`. Needs optax >= 0.2.5.
    """
    contrib = _optax_contrib()
    make = getattr(contrib, "muon", None)
    if make is None:
        raise cfg.field_error(
            "optimizer",
            f"muon needs optax>={MUON_OPTAX} (optax.contrib.muon); optax "
            f"{optax.__version__} is installed: pip install -U 'optax>={MUON_OPTAX}'",
            ConfigDependencyError,
        )
    return make(
        learning_rate,
        ns_steps=ns_steps,
        beta=beta,
        eps=cfg.eps,
        weight_decay=cfg.weight_decay,
        weight_decay_mask=weight_decay_mask,
        nesterov=nesterov,
        adam_b1=cfg.b1,
        adam_b2=cfg.b2,
        adam_weight_decay=adam_weight_decay,
    )


def _optax_contrib() -> Any:
    """`optax.contrib`, or None where this optax has none."""
    try:
        import optax.contrib
    except ImportError:
        return None
    return optax.contrib
