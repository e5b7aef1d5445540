"""Position-wise feed-forward with optional gating (SwiGLU, GeGLU)."""

from __future__ import annotations

import jax

from axplug.config import REQUIRED, ConfigError, Required, config_class
from axplug.layers.base import BaseLayer
from axplug.layers.basic import Linear
from axplug.module import Module
from axplug.sharding import constrain

__all__ = ["FeedForward", "ACTIVATIONS", "HF_ACTIVATIONS", "get_activation", "hf_activation"]


def _gelu_exact(x: jax.Array) -> jax.Array:
    return jax.nn.gelu(x, approximate=False)


# "gelu" is the tanh approximation (jax.nn.gelu's default), also named "gelu_tanh";
# "gelu_exact" the erf form. Hugging Face's "gelu" is the erf form: see HF_ACTIVATIONS.
ACTIVATIONS = {
    "silu": jax.nn.silu,
    "gelu": jax.nn.gelu,
    "gelu_tanh": jax.nn.gelu,  # 0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3)))
    "gelu_exact": _gelu_exact,  # 0.5 x (1 + erf(x / sqrt(2)))
    "quick_gelu": lambda x: x * jax.nn.sigmoid(1.702 * x),  # CLIP's
    "relu": jax.nn.relu,
    "tanh": jax.nn.tanh,
    "linear": lambda x: x,
}

# Hugging Face `hidden_act` / `hidden_activation` names -> the ACTIVATIONS name computing the
# same function. Note "gelu": exact (erf) in Hugging Face, the tanh form here.
HF_ACTIVATIONS = {
    "silu": "silu",
    "swish": "silu",
    "gelu": "gelu_exact",
    "gelu_pytorch_tanh": "gelu_tanh",
    "gelu_new": "gelu_tanh",
    "quick_gelu": "quick_gelu",
    "relu": "relu",
    "tanh": "tanh",
    "linear": "linear",
}


def hf_activation(name: str) -> str:
    """The Hugging Face `hidden_act` of one of ours; ValueError where it has none."""
    name = "gelu_tanh" if name == "gelu" else name  # the same function
    for hf, ours in HF_ACTIVATIONS.items():
        if ours == name:
            return hf
    raise ValueError(f"activation {name!r} has no Hugging Face name")


def get_activation(name: str, path: str = "activation"):
    """An activation by name; unknown names fail listing the known ones."""
    if name not in ACTIVATIONS:
        raise ConfigError(f"{path}: unknown activation {name!r}; choose from {sorted(ACTIVATIONS)}")
    return ACTIVATIONS[name]


class FeedForward(BaseLayer):
    """gated: wo(act(wi_gate x) * wi_up x); otherwise wo(act(wi_up x)).

    SwiGLU is `activation="silu"` (the default), GeGLU with the tanh GELU (Gemma's
    "gelu_pytorch_tanh") `activation="gelu_tanh"`; `activation` names an ACTIVATIONS entry.
    """

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
        return {
            "intermediate_size": cfg.hidden_dim,
            "hidden_act": hf_activation(cfg.activation),
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
