"""Token-choice top-k routing with expert capacity, load-balancing loss and router z-loss."""

from __future__ import annotations

import math
from typing import Any, ClassVar, NamedTuple

import jax
import jax.numpy as jnp

from axplug.api import ParameterSpec
from axplug.api.config import REQUIRED, ConfigError, Required, config_class
from axplug.api.layers import BaseLayer
from axplug.api.sharding import constrain, map_over_batch

__all__ = ["TopKRouter", "DeepSeekRouter", "Routing", "expert_capacity", "group_limited_top_k"]


def expert_capacity(group_size: int, num_experts: int, top_k: int, factor: float | None) -> int:
    """Slots per expert and group: ceil(factor * group_size * top_k / num_experts), at most
    group_size (a token picks an expert once); `factor=None` is drop-free (group_size)."""
    if factor is None:
        return group_size
    return max(1, min(group_size, math.ceil(factor * group_size * top_k / num_experts)))


class Routing(NamedTuple):
    """Where each token's k choices go. All arrays are [groups, group_size, top_k]."""

    expert_index: jax.Array  # int32 expert of each choice
    position: jax.Array  # int32 slot of the choice in its expert's buffer (its arrival order)
    kept: jax.Array  # bool: position < capacity (False: the choice was dropped)
    combine_weights: jax.Array  # float32 gate of the choice, 0 where dropped
    capacity: int  # static slots per expert and group


class TopKRouter(BaseLayer):
    """Softmax over `num_experts` router logits (float32), then each token picks its top-k.

    Capacity: choices claim slots in priority order (every token's first choice, in token
    order, then every second choice...), as in GShard; a choice beyond its expert's
    `capacity` is dropped (its gate becomes 0). Emits `load_balance_loss` and
    `router_z_loss` (already multiplied by their coefficients) as module outputs, and the
    summaries `moe/dropped_fraction` and `moe/expert_load` (group `moe`).
    """

    @config_class
    class Config(BaseLayer.Config):
        input_dim: Required[int] = REQUIRED
        num_experts: Required[int] = REQUIRED
        top_k: int = 2
        # Renormalize the k gates of a token to sum to 1 (Mixtral); else raw probabilities.
        renormalize: bool = True
        # Slots per expert: capacity_factor * tokens * top_k / num_experts; None: drop-free.
        capacity_factor: float | None = 1.25
        load_balance_coefficient: float = 0.01
        z_loss_coefficient: float = 1e-3
        init_scale: float = 1.0

    # Training-only: a trained router computes the same routing whatever they were.
    hf_neutral: ClassVar[tuple[str, ...]] = ("load_balance_coefficient", "z_loss_coefficient")

    @classmethod
    def hf_read(cls, cfg: Any, fields) -> None:
        """Softmax top-k routing without drops, as Hugging Face's MoE layers route."""
        cfg.top_k = fields.positive_int("num_experts_per_tok")
        experts = fields.get("num_local_experts", None)
        if isinstance(experts, int) and cfg.top_k > experts:
            fields.problem(f"num_experts_per_tok={cfg.top_k} exceeds the {experts} experts")
        cfg.renormalize = bool(fields.get("norm_topk_prob", True))
        cfg.capacity_factor = None
        # Hugging Face's balance loss counts each of the k choices, axplug's their mean.
        cfg.load_balance_coefficient = (
            fields.number("router_aux_loss_coef", 0.0, positive=False) * cfg.top_k
        )
        cfg.z_loss_coefficient = 0.0
        fields.expect("router_jitter_noise", 0.0, 0)

    @classmethod
    def hf_write(cls, cfg: Any) -> dict:
        if cfg.capacity_factor is not None:
            raise ValueError(
                f"capacity_factor={cfg.capacity_factor} (Hugging Face MoE layers drop nothing)"
            )
        return {
            "num_experts_per_tok": cfg.top_k,
            "norm_topk_prob": bool(cfg.renormalize),
            "router_aux_loss_coef": cfg.load_balance_coefficient / cfg.top_k,
        }

    def __init__(self, cfg: Config, *, parent=None):
        super().__init__(cfg, parent=parent)
        if not 1 <= cfg.top_k <= cfg.num_experts:
            raise ConfigError(
                f"{self.path}.top_k: {cfg.top_k} must be between 1 and num_experts "
                f"({cfg.num_experts})"
            )
        if cfg.capacity_factor is not None and cfg.capacity_factor <= 0:
            raise ConfigError(
                f"{self.path}.capacity_factor: {cfg.capacity_factor} must be > 0 (None: drop-free)"
            )

    def _create_layer_parameter_specs(self) -> dict[str, ParameterSpec]:
        cfg = self._config
        return {
            "weight": ParameterSpec(
                shape=(cfg.input_dim, cfg.num_experts),
                dtype=self.dtype,
                # Replicated over `expert`: every token scores every expert where it lives.
                mesh_axes=("embed", None),
                initializer=jax.nn.initializers.variance_scaling(
                    cfg.init_scale, "fan_in", "truncated_normal"
                ),
            )
        }

    def forward(self, x: jax.Array) -> Routing:
        # x: [groups, group_size, dim]
        cfg = self._config
        groups, size, _ = x.shape
        num_experts, k = cfg.num_experts, cfg.top_k
        # Routing decisions are discrete: logits in float32 whatever the compute dtype.
        logits = jnp.einsum(
            "gsd,de->gse", x.astype(jnp.float32), self.parameters["weight"].astype(jnp.float32)
        )
        logits = constrain(logits, ("batch", None, None))
        probs, gates, index = self._choose(logits)
        capacity = expert_capacity(size, num_experts, k, cfg.capacity_factor)
        choice = jax.nn.one_hot(index, num_experts, dtype=jnp.int32)  # [g, s, k, e]
        # Priority order k-major: all first choices of the group, then all second choices.
        ordered = choice.transpose(0, 2, 1, 3).reshape(groups, k * size, num_experts)
        position = jnp.sum((jnp.cumsum(ordered, axis=1) - 1) * ordered, axis=-1)
        position = position.reshape(groups, k, size).transpose(0, 2, 1)  # [g, s, k]
        kept = position < capacity
        self._add_losses_and_summaries(logits, probs, choice, kept)
        return Routing(
            expert_index=index.astype(jnp.int32),
            position=position.astype(jnp.int32),
            kept=kept,
            combine_weights=jnp.where(kept, gates, 0.0),
            capacity=capacity,
        )

    def _choose(self, logits: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """(probabilities [g, s, e] for the balance loss, gates [g, s, k], experts [g, s, k])
        of float32 router logits [g, s, e]."""
        cfg = self._config
        probs = jax.nn.softmax(logits, axis=-1)  # [g, s, e]
        # Per device: XLA's partitioner replicates top_k (every group's probabilities
        # gathered onto every device).
        gates, index = map_over_batch(lambda p: jax.lax.top_k(p, cfg.top_k), probs)  # [g, s, k]
        if cfg.renormalize:
            gates = gates / jnp.sum(gates, axis=-1, keepdims=True)
        return probs, gates, index

    def _add_losses_and_summaries(self, logits, probs, choice, kept) -> None:
        cfg = self._config
        # Fraction of the tokens * k choices that pick each expert (before drops); 1/E each
        # when balanced. Switch / GShard: E * sum_e load_e * mean_prob_e, 1.0 when balanced.
        load = jnp.mean(jnp.sum(choice, axis=2), axis=(0, 1)) / cfg.top_k  # [e]
        mean_prob = jnp.mean(probs, axis=(0, 1))  # [e]
        balance = cfg.num_experts * jnp.sum(jax.lax.stop_gradient(load) * mean_prob)
        z = jnp.mean(jnp.square(jax.nn.logsumexp(logits, axis=-1)))
        self.add_module_output("load_balance_loss", cfg.load_balance_coefficient * balance)
        self.add_module_output("router_z_loss", cfg.z_loss_coefficient * z)
        self.add_summary("moe/dropped_fraction", 1.0 - jnp.mean(kept.astype(jnp.float32)))
        self.add_summary("moe/expert_load", load)


def group_limited_top_k(scores: jax.Array, k: int, num_groups: int, top_groups: int):
    """Experts [..., k] of the k highest `scores` [..., e] within the `top_groups` of
    `num_groups` equal groups of experts whose two highest scores sum highest (DeepSeek-V3)."""
    if num_groups > 1:
        *lead, e = scores.shape
        grouped = scores.reshape(*lead, num_groups, e // num_groups)
        group_scores = jnp.sum(jax.lax.top_k(grouped, 2)[0], axis=-1)  # [..., groups]
        _, chosen = jax.lax.top_k(group_scores, top_groups)
        allowed = jnp.any(jax.nn.one_hot(chosen, num_groups, dtype=jnp.bool_), axis=-2)
        allowed = jnp.repeat(allowed, e // num_groups, axis=-1)
        scores = jnp.where(allowed, scores, -jnp.inf)
    return jax.lax.top_k(scores, k)[1]


class DeepSeekRouter(TopKRouter):
    """DeepSeek-V3 routing: sigmoid scores per expert; the choice adds a per-expert
    `e_score_correction_bias` (a parameter of update kind `state`: never trained by gradient)
    and is group-limited (`group_limited_top_k`); the gates are the unbiased scores of the
    chosen experts, renormalized to sum to 1 (`renormalize`), times `scaling_factor`.

    `bias_update_rate` > 0: auxiliary-loss-free balancing in training, each step adding
    rate * sign(mean load - load) to an expert's bias (the underloaded rise); 0 keeps the
    bias as loaded. The balance loss takes the scores normalized per token as its
    probabilities.
    """

    @config_class
    class Config(TopKRouter.Config):
        num_groups: int = 1
        top_groups: int = 1
        scaling_factor: float = 1.0
        bias_update_rate: float = 0.0

    hf_neutral = (*TopKRouter.hf_neutral, "bias_update_rate")

    @classmethod
    def hf_read(cls, cfg: Any, fields) -> None:
        """Top-k, groups, scaling and renormalization of a DeepSeek-V3 config.json."""
        cfg.top_k = fields.positive_int("num_experts_per_tok")
        cfg.renormalize = bool(fields.get("norm_topk_prob", True))
        cfg.num_groups = fields.positive_int("n_group")
        cfg.top_groups = fields.positive_int("topk_group")
        cfg.scaling_factor = fields.number("routed_scaling_factor")
        cfg.capacity_factor = None
        cfg.load_balance_coefficient = 0.0
        cfg.z_loss_coefficient = 0.0
        cfg.bias_update_rate = 0.0
        # DeepSeek's own config.json names its routing; transformers has only this one.
        fields.expect("scoring_func", "sigmoid")
        fields.expect("topk_method", "noaux_tc")
        experts = fields.get("num_local_experts", None)
        if isinstance(experts, int) and cfg.num_groups and cfg.top_groups:
            for problem in _group_problems(experts, cfg.top_k, cfg.num_groups, cfg.top_groups):
                fields.problem(problem)

    @classmethod
    def hf_write(cls, cfg: Any) -> dict:
        if cfg.capacity_factor is not None:
            raise ValueError(
                f"capacity_factor={cfg.capacity_factor} (Hugging Face MoE layers drop nothing)"
            )
        return {
            "num_experts_per_tok": cfg.top_k,
            "norm_topk_prob": bool(cfg.renormalize),
            "n_group": cfg.num_groups,
            "topk_group": cfg.top_groups,
            "routed_scaling_factor": cfg.scaling_factor,
        }

    def __init__(self, cfg: Config, *, parent=None):
        super().__init__(cfg, parent=parent)
        problems = _group_problems(
            cfg.num_experts, cfg.top_k, cfg.num_groups, cfg.top_groups,
            ("num_groups", "top_groups", "top_k"),
        )  # fmt: skip
        if problems:
            raise ConfigError(f"{self.path}.{problems[0]}")
        if cfg.bias_update_rate < 0:
            raise ConfigError(f"{self.path}.bias_update_rate: {cfg.bias_update_rate} must be >= 0")

    def _create_layer_parameter_specs(self) -> dict[str, ParameterSpec]:
        specs = super()._create_layer_parameter_specs()
        # float32 whatever the model's dtype: it decides near-ties between experts.
        specs["e_score_correction_bias"] = ParameterSpec(
            shape=(self._config.num_experts,),
            dtype=jnp.float32,
            mesh_axes=(None,),
            initializer=jax.nn.initializers.zeros,
            weight_decay_scale=0.0,
            update="state",
        )
        return specs

    def _choose(self, logits: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        cfg = self._config
        scores = jax.nn.sigmoid(logits)  # [g, s, e]
        bias = self.parameters["e_score_correction_bias"].astype(jnp.float32)
        index = map_over_batch(
            lambda s: group_limited_top_k(s, cfg.top_k, cfg.num_groups, cfg.top_groups),
            scores + bias,
        )
        gates = jnp.take_along_axis(scores, index, axis=-1)
        if cfg.renormalize:
            gates = gates / (jnp.sum(gates, axis=-1, keepdims=True) + 1e-20)
        gates = gates * cfg.scaling_factor
        return scores / jnp.sum(scores, axis=-1, keepdims=True), gates, index

    def _add_losses_and_summaries(self, logits, probs, choice, kept) -> None:
        super()._add_losses_and_summaries(logits, probs, choice, kept)
        rate = self._config.bias_update_rate
        if rate and self.is_training:
            # In whole counts, so an expert at exactly the mean load keeps its bias.
            counts = jnp.sum(choice, axis=(0, 1, 2))  # [e] int32: choices per expert
            below = jnp.sum(counts) - counts * self._config.num_experts  # mean - load, scaled
            bias = self.parameters["e_score_correction_bias"]
            step = rate * jnp.sign(below).astype(jnp.float32)
            self.add_state_update("e_score_correction_bias", (bias + step).astype(bias.dtype))


_HF_NAMES = ("n_group", "topk_group", "num_experts_per_tok")


def _group_problems(
    experts: int, top_k: int, groups: int, top_groups: int, names=_HF_NAMES
) -> list[str]:
    """What makes a group-limited routing impossible, its fields called by `names`."""
    n_group, topk_group, k = names
    if groups < 1 or experts % groups:
        return [f"{n_group}={groups} does not divide the {experts} experts"]
    per = experts // groups
    if groups > 1 and per < 2:
        return [f"{n_group}={groups} leaves {per} expert per group (a group scores its top 2)"]
    if not 1 <= top_groups <= groups:
        return [f"{topk_group}={top_groups} is not between 1 and {n_group}={groups}"]
    if top_k > top_groups * per:
        return [
            f"{k}={top_k} exceeds the {top_groups * per} experts of {topk_group}={top_groups} "
            "groups"
        ]
    return []
