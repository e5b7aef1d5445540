"""`PolicyCausalLM`: a CausalLM trained on rollouts with a GRPO-family policy loss (the same
parameters, another loss)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from axplug.api.config import ConfigError, config_class
from axplug.api.layers import CausalLM
from axplug_rl.loss import LOSSES, policy_loss

__all__ = ["PolicyCausalLM", "ADVANTAGE_SCALES", "group_advantages_jnp"]

ADVANTAGE_SCALES = ("std", "none")


def group_advantages_jnp(rewards, group_ids, *, scale: str, eps: float):
    """r - the mean of the row's group (rows with the same id), divided by the group's
    unbiased std + eps when `scale` is "std" (GRPO); not divided with "none" (Dr. GRPO)."""
    rewards = rewards.astype(jnp.float32)
    same = (group_ids[:, None] == group_ids[None, :]).astype(jnp.float32)
    count = same.sum(axis=1)
    mean = same @ rewards / count
    centred = rewards - mean
    if scale == "none":
        return centred
    spread = same * (rewards[None, :] - mean[:, None]) ** 2
    std = jnp.sqrt(spread.sum(axis=1) / jnp.maximum(count - 1, 1))
    return centred / (std + eps)


class PolicyCausalLM(CausalLM):
    """A `CausalLM` whose loss is a policy-gradient loss over completions (`--input rollouts`).

    A batch row is a prompt and one sampled completion: `target_labels` counts only the
    completion's tokens, `rewards` and `group_ids` give each row's reward and the prompt it
    answers (advantages are relative to the group), `behavior_logps` the sampler's (the
    Engine's) log-probabilities of those tokens, `old_logps` the policy's at rollout time when
    a batch is reused for several updates (else the current ones, without gradient: the ratio
    is 1), `ref_logps` a reference model's (the KL term). Its parameters are the CausalLM's, so
    `train --from`, `generate`, `export-hf` and `--modifier lora` work unchanged.
    """

    @config_class
    class Config(CausalLM.Config):
        loss: str = "grpo"  # grpo, dr_grpo, dapo, gspo
        clip_low: float | None = None  # None: the loss's default (DEFAULT_CLIP)
        clip_high: float | None = None
        advantage_scale: str | None = None  # std or none; None: none for dr_grpo, else std
        advantage_eps: float = 1e-4
        kl_beta: float = 0.0  # > 0: k3 KL to ref_logps, which the batch must then carry
        max_tokens: int | None = None  # dr_grpo's constant length; None: the row length
        tis_cap: float | None = None  # truncated importance weights to behavior_logps

    def __init__(self, cfg: Config, *, parent=None):
        super().__init__(cfg, parent=parent)
        if cfg.loss not in LOSSES:
            raise ConfigError(f"{self.path}.loss: {cfg.loss!r}; choose from {LOSSES}")
        if self.advantage_scale not in ADVANTAGE_SCALES:
            raise ConfigError(
                f"{self.path}.advantage_scale: {cfg.advantage_scale!r}; choose from "
                f"{ADVANTAGE_SCALES} (or None: by the loss)"
            )
        for name in ("clip_low", "clip_high", "kl_beta"):
            value = getattr(cfg, name)
            if value is not None and value < 0:
                raise ConfigError(f"{self.path}.{name}: must be >= 0, got {value}")
        if cfg.tis_cap is not None and cfg.tis_cap <= 0:
            raise ConfigError(f"{self.path}.tis_cap: must be > 0 (None: off), got {cfg.tis_cap}")

    @property
    def advantage_scale(self) -> str:
        scale = self._config.advantage_scale
        return scale if scale is not None else ("none" if self._config.loss == "dr_grpo" else "std")

    def forward(
        self, input_ids, target_labels, *, rewards=None, group_ids=None, behavior_logps=None,
        old_logps=None, ref_logps=None, positions=None, segment_ids=None,
    ):  # fmt: skip
        cfg = self._config
        if rewards is None or group_ids is None:
            raise ConfigError(
                f"{self.path}: the batch has no rewards; a policy loss trains on rollouts: "
                "use --input rollouts:prompts=FILE,..."
            )
        if cfg.kl_beta > 0 and ref_logps is None:
            raise ConfigError(
                f"{self.path}: kl_beta={cfg.kl_beta} needs the reference's log-probabilities; "
                "set the rollouts input's reference (e.g. reference=adapters_off with LoRA)"
            )
        if self.decoder.fuses_loss:
            raise ConfigError(f"{self.path}: a policy loss needs the logits; not with 1F1B")
        logits = self.decoder(input_ids, positions=positions, segment_ids=segment_ids)
        logp_all = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
        mask = target_labels >= 0
        labels = jnp.maximum(target_labels, 0)[..., None]
        logps = jnp.where(mask, jnp.take_along_axis(logp_all, labels, axis=-1)[..., 0], 0.0)
        current = jax.lax.stop_gradient(logps)
        old = current if old_logps is None else old_logps
        behavior = None
        if behavior_logps is not None:  # NaN where the sampler gave none (a stop token)
            behavior = jnp.where(mask & ~jnp.isnan(behavior_logps), behavior_logps, old)
        advantages = group_advantages_jnp(  # per row values, repeated along the row
            rewards[:, 0], group_ids[:, 0], scale=self.advantage_scale, eps=cfg.advantage_eps
        )
        loss, metrics = policy_loss(
            logps, old, advantages, mask, kind=cfg.loss, clip_low=cfg.clip_low,
            clip_high=cfg.clip_high, ref_logps=ref_logps if cfg.kl_beta > 0 else None,
            kl_beta=cfg.kl_beta, max_tokens=cfg.max_tokens or target_labels.shape[-1],
            tis_cap=cfg.tis_cap, behavior_logps=behavior if cfg.tis_cap else None,
        )  # fmt: skip
        count = jnp.maximum(mask.sum(), 1)
        probs = jnp.exp(jax.lax.stop_gradient(logp_all))
        entropy = -(probs * jax.lax.stop_gradient(logp_all)).sum(-1)
        metrics["entropy"] = jnp.where(mask, entropy, 0.0).sum() / count
        metrics["advantage_abs"] = jnp.abs(advantages).mean()
        if behavior is not None:  # training-inference mismatch, per completion token
            metrics["logp_gap"] = jnp.where(mask, jnp.abs(behavior - current), 0.0).sum() / count
            metrics["logp_gap_max"] = jnp.where(mask, jnp.abs(behavior - current), 0.0).max()
        for name, value in metrics.items():
            self.add_summary(f"rl/{name}", jax.lax.stop_gradient(value))
        self.add_summary("loss", loss)
        return loss, {"logits": logits, "num_tokens": mask.sum()}
