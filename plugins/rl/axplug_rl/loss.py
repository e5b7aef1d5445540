"""GRPO-family policy losses over the masked tokens of sampled completions.

grpo (Shao et al. 2024, DeepSeekMath): PPO's clipped surrogate per token, averaged over each
completion's tokens, then over completions. dr_grpo (Liu et al. 2025, "Understanding R1-Zero-Like
Training"): the batch's summed token losses over a constant, rows x maximum completion length, so
no length bias. dapo (Yu et al. 2025): the token-level mean over the batch, with a wider upper
clip (clip-higher). gspo (Zheng et al. 2025, "Group Sequence Policy Optimization"): one
length-normalised importance ratio per completion, clipped per completion. Each can add the k3
KL estimator against a reference model and truncated importance sampling against a sampler whose
log-probabilities are not bit-equal to the trainer's.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

__all__ = ["LOSSES", "DEFAULT_CLIP", "policy_loss"]

LOSSES = ("grpo", "dr_grpo", "dapo", "gspo")
DEFAULT_CLIP = {
    "grpo": (0.2, 0.2),
    "dr_grpo": (0.2, 0.2),
    "dapo": (0.2, 0.28),
    "gspo": (3e-4, 4e-4),
}


def _clipped_surrogate(
    ratio: jax.Array, adv: jax.Array, low: float, high: float
) -> tuple[jax.Array, jax.Array]:
    """(-min(r A, clip(r, 1 - low, 1 + high) A), where the clipped branch is the smaller)."""
    clipped = ((adv > 0) & (ratio > 1.0 + high)) | ((adv < 0) & (ratio < 1.0 - low))
    # The branch min() takes, chosen explicitly: a tie (ratio inside the range) then carries the
    # unclipped gradient whole rather than split between two equal branches.
    bound = jnp.clip(ratio, 1.0 - low, 1.0 + high)
    return -jnp.where(clipped, bound, ratio) * adv, clipped


def _masked_stats(counted: jax.Array, ratio: jax.Array, clipped: jax.Array) -> dict:
    """clip_fraction and the ratios' mean, min and max over the counted entries (0 if none)."""
    n = jnp.maximum(jnp.sum(counted), 1)
    some = jnp.any(counted)
    return {
        "clip_fraction": jnp.sum(counted & clipped) / n,
        "ratio_mean": jnp.sum(jnp.where(counted, ratio, 0.0)) / n,
        "ratio_min": jnp.where(some, jnp.min(jnp.where(counted, ratio, jnp.inf)), 0.0),
        "ratio_max": jnp.where(some, jnp.max(jnp.where(counted, ratio, -jnp.inf)), 0.0),
    }


def _check(
    kind: str,
    low: float,
    high: float,
    ref_logps: ArrayLike | None,
    kl_beta: float,
    max_tokens: int | None,
    tis_cap: float | None,
    behavior_logps: ArrayLike | None,
) -> None:
    """Raise ValueError for an argument `policy_loss` cannot use."""
    if kind not in LOSSES:
        raise ValueError(f"kind must be one of {', '.join(LOSSES)}; got {kind!r}")
    if low < 0 or high < 0:
        raise ValueError(f"clip_low and clip_high must be >= 0; got {low}, {high}")
    if kl_beta < 0:
        raise ValueError(f"kl_beta must be >= 0; got {kl_beta}")
    if kl_beta > 0 and ref_logps is None:
        raise ValueError("kl_beta > 0 needs ref_logps, the reference model's log-probabilities")
    if kind == "dr_grpo" and (max_tokens is None or max_tokens < 1):
        raise ValueError(
            f"dr_grpo needs max_tokens, the maximum completion length (>= 1); got {max_tokens}"
        )
    if tis_cap is not None:
        if behavior_logps is None:
            raise ValueError("tis_cap needs behavior_logps, the sampler's log-probabilities")
        if tis_cap <= 0:
            raise ValueError(f"tis_cap must be > 0; got {tis_cap}")


def policy_loss(
    logps: ArrayLike,
    old_logps: ArrayLike,
    advantages: ArrayLike,
    mask: ArrayLike,
    *,
    kind: str = "grpo",
    clip_low: float | None = None,
    clip_high: float | None = None,
    ref_logps: ArrayLike | None = None,
    kl_beta: float = 0.0,
    max_tokens: int | None = None,
    tis_cap: float | None = None,
    behavior_logps: ArrayLike | None = None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """(scalar loss, metrics) of the `kind` policy loss over the completions' masked tokens."""
    default_low, default_high = DEFAULT_CLIP.get(kind, (0.0, 0.0))
    low = default_low if clip_low is None else float(clip_low)
    high = default_high if clip_high is None else float(clip_high)
    _check(kind, low, high, ref_logps, kl_beta, max_tokens, tis_cap, behavior_logps)
    logps = jnp.asarray(logps, jnp.float32)
    const = lambda x: jax.lax.stop_gradient(jnp.asarray(x, jnp.float32))
    old, adv = const(old_logps), const(advantages)
    counted = jnp.asarray(mask).astype(bool)
    if counted.shape != logps.shape or old.shape != logps.shape or adv.shape != logps.shape[:1]:
        raise ValueError(
            f"logps, old_logps and mask must be [B, T] and advantages [B]; got {logps.shape}, "
            f"{old.shape}, {counted.shape}, {adv.shape}"
        )
    rows = logps.shape[0]
    count = jnp.sum(counted, axis=-1)
    per_row = jnp.maximum(count, 1)
    total = jnp.maximum(jnp.sum(count), 1)
    # Differences are zeroed at masked-out positions before any exp: garbage there could
    # overflow, and a zero cotangent times an infinite derivative is NaN in the gradient.
    log_ratio = jnp.where(counted, logps - old, 0.0)
    use_kl = kl_beta > 0
    if use_kl:
        to_ref = jnp.where(counted, const(ref_logps) - logps, 0.0)
        k3 = jnp.exp(to_ref) - to_ref - 1.0
    else:
        k3 = jnp.zeros_like(logps)
    # Truncated importance sampling's log-weights; zero (weight 1) when it is off.
    tis = tis_cap is not None
    log_w = jnp.where(counted, old - const(behavior_logps), 0.0) if tis else jnp.zeros_like(old)
    cap = jnp.inf if tis_cap is None else tis_cap

    if kind == "gspo":
        has_tokens = count > 0
        ratio = jnp.exp(jnp.sum(log_ratio, axis=-1) / per_row)
        surrogate, clipped = _clipped_surrogate(ratio, adv, low, high)
        weight = jax.lax.stop_gradient(jnp.minimum(jnp.exp(jnp.sum(log_w, axis=-1) / per_row), cap))
        row_loss = surrogate * weight + kl_beta * jnp.sum(k3, axis=-1) / per_row
        loss = jnp.sum(jnp.where(has_tokens, row_loss, 0.0)) / rows
        units = has_tokens
    else:
        ratio = jnp.exp(log_ratio)
        surrogate, clipped = _clipped_surrogate(ratio, adv[:, None], low, high)
        weight = jax.lax.stop_gradient(jnp.minimum(jnp.exp(log_w), cap))
        token_loss = surrogate * weight + kl_beta * k3
        token_loss = jnp.where(counted, token_loss, 0.0)
        if kind == "grpo":
            loss = jnp.sum(jnp.sum(token_loss, axis=-1) / per_row) / rows
        elif kind == "dr_grpo":
            assert max_tokens is not None  # _check
            loss = jnp.sum(token_loss) / (rows * max_tokens)
        else:
            loss = jnp.sum(token_loss) / total
        units = counted

    metrics = _masked_stats(units, ratio, clipped)
    metrics["kl"] = jnp.sum(k3) / total if use_kl else jnp.zeros((), jnp.float32)
    if tis:
        n = jnp.maximum(jnp.sum(units), 1)
        metrics["tis_mean"] = jnp.sum(jnp.where(units, weight, 0.0)) / n
    return loss, jax.lax.stop_gradient(metrics)
