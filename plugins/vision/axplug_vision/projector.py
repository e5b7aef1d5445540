"""Projectors from a vision tower's features to a language model's embeddings."""

from __future__ import annotations

import jax

from axplug.api.config import REQUIRED, Required, config_class
from axplug.api.layers import HF_ACTIVATIONS, BaseLayer, Linear, get_activation, hf_activation

__all__ = ["MLPProjector"]


class MLPProjector(BaseLayer):
    """LLaVA's projector: `linear_2(act(linear_1(features)))`, [..., input_dim] -> [...,
    output_dim]."""

    @config_class
    class Config(BaseLayer.Config):
        input_dim: Required[int] = REQUIRED
        output_dim: Required[int] = REQUIRED
        activation: str = "gelu_exact"
        bias: bool = True

    @classmethod
    def hf_read(cls, cfg: Config, fields) -> None:
        act = fields.get("projector_hidden_act", "gelu")
        if act not in HF_ACTIVATIONS:
            fields.problem(f"projector_hidden_act={act!r} (supported: {', '.join(HF_ACTIVATIONS)})")
        cfg.activation = HF_ACTIVATIONS.get(act, cfg.activation)
        cfg.bias = bool(fields.get("multimodal_projector_bias", True))

    @classmethod
    def hf_write(cls, cfg: Config) -> dict:
        return {
            "projector_hidden_act": hf_activation(cfg.activation),
            "multimodal_projector_bias": cfg.bias,
        }

    def __init__(self, cfg: Config, *, parent=None):
        super().__init__(cfg, parent=parent)
        linear = Linear.default_config().set(bias=cfg.bias, mesh_axes=(None, "embed"))
        self._add_child(
            "linear_1", linear.clone(input_dim=cfg.input_dim, output_dim=cfg.output_dim)
        )
        self._add_child(
            "linear_2", linear.clone(input_dim=cfg.output_dim, output_dim=cfg.output_dim)
        )

    def forward(self, features: jax.Array) -> jax.Array:
        act = get_activation(self._config.activation)
        return self.linear_2(act(self.linear_1(features)))
