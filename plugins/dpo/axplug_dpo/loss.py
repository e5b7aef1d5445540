"""Sequence log-probabilities and the preference losses: DPO (sigmoid), IPO and SimPO."""

from __future__ import annotations

import jax
import jax.numpy as jnp

__all__ = ["LOSSES", "sequence_logps", "preference_loss"]

LOSSES = ("sigmoid", "ipo", "simpo")


def sequence_logps(logits: jax.Array, labels: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(sum of log p(label) over the counted targets (labels >= 0), their number), per row."""
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    counted = labels >= 0
    picked = jnp.take_along_axis(logp, jnp.maximum(labels, 0)[..., None], axis=-1)[..., 0]
    return jnp.sum(jnp.where(counted, picked, 0.0), axis=-1), jnp.sum(counted, axis=-1)


def preference_loss(
    policy: jax.Array,
    reference: jax.Array | None,
    counts: jax.Array,
    *,
    beta: float,
    kind: str = "sigmoid",
    simpo_gamma: float = 0.5,
) -> tuple[jax.Array, dict]:
    """(mean loss, metrics) of rows that alternate chosen, rejected.

    sigmoid (Rafailov et al., 2023): -log sigmoid(beta ((c - c_ref) - (r - r_ref))) of the
    responses' summed log-probabilities. ipo (Azar et al., 2023): ((c - c_ref) - (r - r_ref)
    - 1 / (2 beta))^2 of per-token means. simpo (Meng et al., 2024): -log sigmoid(beta (c -
    r) - gamma) of per-token means, no reference.
    """
    chosen, rejected = policy[0::2], policy[1::2]
    n_chosen, n_rejected = jnp.maximum(counts[0::2], 1), jnp.maximum(counts[1::2], 1)
    raw = {"chosen_logps": jnp.mean(chosen), "rejected_logps": jnp.mean(rejected)}
    if kind == "simpo":
        c, r = chosen / n_chosen, rejected / n_rejected
        chosen_reward, rejected_reward = beta * c, beta * r
        loss = -jax.nn.log_sigmoid(chosen_reward - rejected_reward - simpo_gamma)
    else:
        assert reference is not None, f"{kind} needs the reference's log-probabilities"
        ref_c, ref_r = reference[0::2], reference[1::2]
        if kind == "ipo":
            chosen, rejected = chosen / n_chosen, rejected / n_rejected
            ref_c, ref_r = ref_c / n_chosen, ref_r / n_rejected
        chosen_reward, rejected_reward = beta * (chosen - ref_c), beta * (rejected - ref_r)
        margin = (chosen - ref_c) - (rejected - ref_r)
        if kind == "ipo":
            loss = (margin - 1 / (2 * beta)) ** 2
        else:
            loss = -jax.nn.log_sigmoid(beta * margin)
    metrics = {
        **raw,
        "chosen_reward": jnp.mean(chosen_reward),
        "rejected_reward": jnp.mean(rejected_reward),
        "reward_margin": jnp.mean(chosen_reward - rejected_reward),
        "accuracy": jnp.mean((chosen_reward > rejected_reward).astype(jnp.float32)),
    }
    return jnp.mean(loss), metrics
