"""The mixture-of-experts feed-forward: a drop-in for the dense `FeedForward` slot."""

from __future__ import annotations

from typing import Any

import jax

from axplug.api import ParameterSpec
from axplug.api.config import REQUIRED, ConfigError, Required, config_class
from axplug.api.layers import BaseLayer, FeedForward, Linear, get_activation
from axplug_moe.dispatch import Experts
from axplug_moe.dispatchers import AutoDispatch
from axplug_moe.router import TopKRouter

__all__ = ["MoEFeedForward"]


class MoEFeedForward(BaseLayer):
    """`num_experts` gated FFNs (SwiGLU by default); each token runs the `router.top_k`
    experts it picks, weighted by its gates, plus `num_shared_experts` experts every token
    runs; with `shared_expert_gate` their output is scaled per token by
    sigmoid(x @ w), w a [dim, 1] Linear without bias (Qwen2-MoE's `shared_expert_gate`).

    Fields shared with `FeedForward` (input_dim, hidden_dim, activation, gated) mean the
    same, per expert, so `replace_config` carries them over from the dense layer. Tokens
    are routed in groups of one sequence: capacity and drops never depend on other
    sequences of the batch or on how the batch is sharded.
    """

    @config_class
    class Config(BaseLayer.Config):
        input_dim: Required[int] = REQUIRED
        hidden_dim: Required[int] = REQUIRED  # per expert
        activation: str = "silu"
        gated: bool = True
        num_experts: int = 8
        num_shared_experts: int = 0
        shared_hidden_dim: int | None = None  # per shared expert; None: hidden_dim
        # Scale the shared experts' output by sigmoid(x @ w) per token (child
        # `shared_expert_gate`, a Linear dim -> 1 without bias); needs num_shared_experts.
        shared_expert_gate: bool = False
        init_scale: float = 1.0
        # Routing: top_k, renormalize, capacity_factor and the aux-loss coefficients.
        router: BaseLayer.Config = TopKRouter.default_config()
        dispatch: BaseLayer.Config = AutoDispatch.default_config()
        # The shared experts' FFN (one of num_shared_experts * hidden); None: a FeedForward.
        shared_expert: BaseLayer.Config | None = None

    @classmethod
    def hf_read(cls, cfg: Any, fields) -> None:
        """Experts, their width (`moe_intermediate_size`; Mixtral aliases it to
        intermediate_size) and the shared experts from a Hugging Face config.json."""
        from axplug.api.layers import HF_ACTIVATIONS

        cfg.num_experts = fields.positive_int("num_local_experts")
        cfg.hidden_dim = fields.positive_int("moe_intermediate_size")
        act = fields.get("hidden_act", "silu")
        if act not in HF_ACTIVATIONS:
            fields.problem(f"hidden_act={act!r} (supported: {', '.join(HF_ACTIVATIONS)})")
        cfg.activation = HF_ACTIVATIONS.get(act, cfg.activation)
        cfg.gated = True
        # Shared experts, as one FFN: one of `shared_expert_intermediate_size` (Qwen2-MoE),
        # gated by a sigmoid where the family's code gates it (`shared_expert_gate`, an
        # implied field); or `n_shared_experts` of moe_intermediate_size each, ungated
        # (DeepSeek-V3). A family implies the one it does not have to be None.
        width = fields.get("shared_expert_intermediate_size", None)
        count = fields.get("n_shared_experts", None)
        cfg.num_shared_experts, cfg.shared_hidden_dim = 0, None
        cfg.shared_expert_gate = False
        if width is not None and count is not None:
            fields.problem(
                "both shared_expert_intermediate_size and n_shared_experts are set (a family "
                "has one)"
            )
        elif width is not None:
            cfg.num_shared_experts = 1
            cfg.shared_hidden_dim = fields.positive_int("shared_expert_intermediate_size")
            cfg.shared_expert_gate = bool(fields.get("shared_expert_gate", False))
        elif count is not None:
            if isinstance(count, bool) or not isinstance(count, int) or count < 0:
                fields.problem(f"n_shared_experts={count!r} (expected an integer >= 0)")
                count = 0
            cfg.num_shared_experts = count

    @classmethod
    def hf_write(cls, cfg: Any) -> dict:
        if not cfg.gated:
            raise ValueError("experts that are not gated")
        from axplug.api.layers import hf_activation

        out = {
            "num_local_experts": cfg.num_experts,
            "moe_intermediate_size": cfg.hidden_dim,
            "hidden_act": hf_activation(cfg.activation),
            "shared_expert_intermediate_size": None,
            "n_shared_experts": None,
        }
        if cfg.num_shared_experts:
            if cfg.shared_expert is not None and cfg.shared_expert.klass is not FeedForward:
                raise ValueError(
                    f"a shared expert of class {cfg.shared_expert.klass} (Hugging Face "
                    "shared experts are gated MLPs: a FeedForward)"
                )
            width = cfg.num_shared_experts * (cfg.shared_hidden_dim or cfg.hidden_dim)
            out["shared_expert_intermediate_size"] = width
            out["shared_expert_gate"] = bool(cfg.shared_expert_gate)
            if cfg.shared_hidden_dim in (None, cfg.hidden_dim) and not cfg.shared_expert_gate:
                out["n_shared_experts"] = cfg.num_shared_experts  # DeepSeek's form
        return out

    def __init__(self, cfg: Config, *, parent=None):
        super().__init__(cfg, parent=parent)
        if cfg.num_experts < 1:
            raise ConfigError(f"{self.path}.num_experts: {cfg.num_experts} must be >= 1")
        if cfg.num_shared_experts < 0:
            raise ConfigError(
                f"{self.path}.num_shared_experts: {cfg.num_shared_experts} must be >= 0"
            )
        self._act = get_activation(cfg.activation, f"{self.path}.activation")
        self._add_child(
            "router",
            cfg.router.clone(input_dim=cfg.input_dim, num_experts=cfg.num_experts),
        )
        self._add_child("dispatch", cfg.dispatch)
        if cfg.num_shared_experts:
            hidden = cfg.num_shared_experts * (cfg.shared_hidden_dim or cfg.hidden_dim)
            shared = cfg.shared_expert or FeedForward.default_config()
            self._add_child(
                "shared_expert",
                shared.clone(
                    input_dim=cfg.input_dim,
                    hidden_dim=hidden,
                    activation=cfg.activation,
                    gated=cfg.gated,
                ),
            )
        if cfg.shared_expert_gate:
            if not cfg.num_shared_experts:
                raise cfg.field_error(
                    "shared_expert_gate", "gates the shared experts: set num_shared_experts >= 1"
                )
            self._add_child(
                "shared_expert_gate",
                Linear.default_config().set(
                    input_dim=cfg.input_dim, output_dim=1, mesh_axes=("embed", None)
                ),
            )

    def _create_layer_parameter_specs(self) -> dict[str, ParameterSpec]:
        cfg = self._config
        e, d, h = cfg.num_experts, cfg.input_dim, cfg.hidden_dim
        # Per expert the dense layer's fan-in init; the expert dim is a batch dim.
        init = jax.nn.initializers.variance_scaling(
            cfg.init_scale, "fan_in", "truncated_normal", in_axis=-2, out_axis=-1, batch_axis=(0,)
        )
        up = ParameterSpec((e, d, h), self.dtype, ("expert", "embed", "mlp"), init)
        specs = {
            "wi_up": up,
            "wo": ParameterSpec((e, h, d), self.dtype, ("expert", "mlp", "embed"), init),
        }
        if cfg.gated:
            specs["wi_gate"] = up
        return specs

    def active_parameter_fraction(self) -> float:
        """The share of this layer's own (expert) weights one token runs: top_k / experts."""
        return self.router.config.top_k / self._config.num_experts

    def forward(self, x: jax.Array) -> jax.Array:
        # x: [..., seq, dim]; each sequence is one routing group.
        shape = x.shape
        x = self.cast(x.reshape(-1, *shape[-2:]) if x.ndim >= 2 else x.reshape(1, 1, -1))
        params = self.parameters
        experts = Experts(
            wi_up=self.cast(params["wi_up"]),
            wo=self.cast(params["wo"]),
            wi_gate=self.cast(params["wi_gate"]) if "wi_gate" in params else None,
            activation=self._act,
        )
        routing = self.router(x)
        y = self.dispatch(x, routing, experts)
        if self._config.num_shared_experts:
            shared = self.shared_expert(x)
            if self._config.shared_expert_gate:
                shared = jax.nn.sigmoid(self.shared_expert_gate(x)) * shared
            y = y + shared
        return y.astype(self.compute_dtype).reshape(shape)
