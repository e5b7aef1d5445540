"""Position-wise feed-forward with optional gating (SwiGLU, GeGLU)."""

from __future__ import annotations

import jax

from axplug.config import REQUIRED, ConfigError, Required, config_class
from axplug.layers.base import BaseLayer
from axplug.layers.basic import Linear
from axplug.module import Module
from axplug.sharding import constrain

__all__ = ["FeedForward", "ACTIVATIONS", "HF_ACTIVATIONS", "get_activation"]

ACTIVATIONS = {
    "silu": jax.nn.silu,
    "gelu": jax.nn.gelu,
    "gelu_exact": lambda x: jax.nn.gelu(x, approximate=False),
    "relu": jax.nn.relu,
    "tanh": jax.nn.tanh,
    "linear": lambda x: x,
}

# Hugging Face `hidden_act` names -> ours (the first name of each is what an export writes).
HF_ACTIVATIONS = {
    "silu": "silu",
    "gelu_pytorch_tanh": "gelu",
    "gelu_new": "gelu",
    "gelu": "gelu_exact",
    "relu": "relu",
}


def get_activation(name: str, path: str = "activation"):
    """An activation by name; unknown names fail listing the known ones."""
    if name not in ACTIVATIONS:
        raise ConfigError(f"{path}: unknown activation {name!r}; choose from {sorted(ACTIVATIONS)}")
    return ACTIVATIONS[name]


class FeedForward(BaseLayer):
    """gated: wo(act(wi_gate x) * wi_up x); otherwise wo(act(wi_up x))."""

    @config_class
    class Config(BaseLayer.Config):
        input_dim: Required[int] = REQUIRED
        hidden_dim: Required[int] = REQUIRED
        activation: str = "silu"
        gated: bool = True
        linear: Linear.Config = Linear.default_config()

    @classmethod
    def hf_read(cls, cfg: Config, fields) -> None:
        """Width, activation and bias; gating is the architecture's choice."""
        cfg.hidden_dim = fields.positive_int("intermediate_size")
        act = fields.get("hidden_act", "silu")
        if act not in HF_ACTIVATIONS:
            fields.problem(
                f"{fields.name('hidden_act')}={act!r} (supported: {', '.join(HF_ACTIVATIONS)})"
            )
        cfg.activation = HF_ACTIVATIONS.get(act, cfg.activation)
        cfg.linear.bias = bool(fields.get("mlp_bias", False))

    @classmethod
    def hf_write(cls, cfg: Config) -> dict:
        names = [hf for hf, ours in HF_ACTIVATIONS.items() if ours == cfg.activation]
        if not names:
            raise ValueError(f"activation {cfg.activation!r} has no Hugging Face name")
        return {
            "intermediate_size": cfg.hidden_dim,
            "hidden_act": names[0],
            "mlp_bias": cfg.linear.bias,
        }

    def __init__(self, cfg: Config, *, parent: Module | None = None):
        super().__init__(cfg, parent=parent)
        self._act = get_activation(cfg.activation, f"{self.path}.activation")
        up = cfg.linear.clone(input_dim=cfg.input_dim, output_dim=cfg.hidden_dim)
        if cfg.gated:
            self._add_child("wi_gate", up)
        self._add_child("wi_up", up)
        self._add_child(
            "wo",
            cfg.linear.clone(
                input_dim=cfg.hidden_dim, output_dim=cfg.input_dim, mesh_axes=("mlp", "embed")
            ),
        )

    def forward(self, x: jax.Array) -> jax.Array:
        h = self.wi_up(x)
        h = self._act(self.wi_gate(x)) * h if self._config.gated else self._act(h)
        return self.wo(constrain(h, ("batch", "seq", "mlp")))
