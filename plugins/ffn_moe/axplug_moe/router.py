"""Token-choice top-k routing with expert capacity, load-balancing loss and router z-loss."""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from axplug.config import REQUIRED, ConfigError, Required, config_class
from axplug.layers import BaseLayer, ParameterSpec
from axplug.sharding import constrain, map_over_batch

__all__ = ["TopKRouter", "Routing", "expert_capacity"]


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
    hf_neutral = ("load_balance_coefficient", "z_loss_coefficient")

    @classmethod
    def hf_read(cls, cfg: Config, fields) -> None:
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
    def hf_write(cls, cfg: Config) -> dict:
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
        probs = jax.nn.softmax(logits, axis=-1)  # [g, s, e]
        # Per device: XLA's partitioner replicates top_k (every group's probabilities
        # gathered onto every device).
        gates, index = map_over_batch(lambda p: jax.lax.top_k(p, k), probs)  # [g, s, k]
        if cfg.renormalize:
            gates = gates / jnp.sum(gates, axis=-1, keepdims=True)
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
