"""A ViT image encoder as a layer: patches, a linear patch embedding, an optional class token,
learned positions, an optional pre-norm, bidirectional transformer layers and a post-norm.
Its Hugging Face fields are a vision config's (`vision_config` of a vision-language model).

CLIP's vision tower: class token, pre-norm, quick GELU, the post-norm on the class token only
(`post_norm_all=False`). SigLIP's: no class token, a biased patch embedding, the tanh GELU,
the post-norm on every patch.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from axplug.api import ParameterSpec
from axplug.api.config import REQUIRED, Required, config_class
from axplug.api.layers import (
    Attention,
    BaseLayer,
    FeedForward,
    LayerNorm,
    StackedTransformer,
    TransformerLayer,
    hf_activation,
)

__all__ = ["HF_DEFAULTS", "TOWERS", "VisionTransformer", "patchify"]

# Each tower's Hugging Face config class's values, for the fields a published (sparse)
# vision_config leaves out.
_VIT_BASE = dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12,
                 num_attention_heads=12, num_channels=3, attention_dropout=0.0)  # fmt: skip
HF_DEFAULTS = {
    "clip_vision_model": dict(
        _VIT_BASE, image_size=224, patch_size=32, hidden_act="quick_gelu", layer_norm_eps=1e-5
    ),  # fmt: skip
    "siglip_vision_model": dict(
        _VIT_BASE,
        image_size=224,
        patch_size=16,
        hidden_act="gelu_pytorch_tanh",
        layer_norm_eps=1e-6,
    ),  # fmt: skip
}
# Hugging Face vision config model_type -> how the tower differs from the ViT defaults.
TOWERS = {
    # A class token, a pre-norm, the post-norm on the pooled class token only.
    "clip_vision_model": dict(class_token=True, pre_norm=True, post_norm_all=False),
    # No class token, a biased patch embedding, the post-norm on every patch (the attention
    # pooling head, `vision_use_head`, is not read: vision-language models drop it).
    "siglip_vision_model": dict(class_token=False, patch_bias=True, post_norm_all=True),
}


def patchify(pixels: jax.Array, patch: int) -> jax.Array:
    """[batch, channels, height, width] -> [batch, patches, channels * patch * patch]: row-major
    patches, each flattened channel first (a stride-`patch` convolution's weight order)."""
    b, c, h, w = pixels.shape
    x = pixels.reshape(b, c, h // patch, patch, w // patch, patch)
    return x.transpose(0, 2, 4, 1, 3, 5).reshape(b, (h // patch) * (w // patch), c * patch * patch)


def _layer_config() -> TransformerLayer.Config:
    """A bidirectional encoder layer: LayerNorms, biased projections, an ungated MLP."""
    attention = Attention.default_config().set(causal=False)
    attention.qkv.bias = attention.output.bias = True
    feed_forward = FeedForward.default_config().set(gated=False, activation="gelu_tanh")
    feed_forward.linear.bias = True
    return TransformerLayer.default_config().set(
        attention=attention, feed_forward=feed_forward, norm=LayerNorm.default_config()
    )


class VisionTransformer(BaseLayer):
    """`forward(pixels [batch, channels, height, width])` -> (hidden [batch, tokens, dim],
    pooled [batch, dim]): tokens are the class token (if any) then the patches; pooled is the
    normed class token, or the patches' mean without one."""

    @config_class
    class Config(BaseLayer.Config):
        image_size: Required[int] = REQUIRED
        patch_size: Required[int] = REQUIRED
        num_channels: int = 3
        dim: Required[int] = REQUIRED
        class_token: bool = True
        patch_bias: bool = False
        pre_norm: bool = False
        # The post-norm on every token (SigLIP), or on the pooled class token only (CLIP).
        post_norm_all: bool = False
        norm: LayerNorm.Config = LayerNorm.default_config()
        transformer: BaseLayer.Config = StackedTransformer.default_config().set(
            layer=_layer_config()
        )

    hf_writes_subtree = True  # its attention is not a causal LM's
    # What CLIP's and SigLIP's code fixes: every projection has a bias.
    hf_implied = {"qkv_bias": True, "attention_bias": True, "mlp_bias": True}
    hf_defaults = HF_DEFAULTS  # by model_type

    @classmethod
    def hf_read(cls, cfg: Config, fields) -> None:
        """The tower's own fields of a Hugging Face vision config; its layers read theirs."""
        cfg.image_size = fields.positive_int("image_size")
        cfg.patch_size = fields.positive_int("patch_size")
        cfg.num_channels = fields.positive_int("num_channels", 3)
        cfg.dim = fields.positive_int("hidden_size")
        fields.get("projection_dim", None)  # CLIP's joint image-text width: not the tower's
        fields.get("initializer_factor", None)
        fields.expect("vision_use_head", False, why="the attention-pooling head is not read")

    @classmethod
    def hf_write(cls, cfg: Config) -> dict:
        layer = cfg.transformer.layer
        ffn = layer.feed_forward
        kinds = [k for k, v in TOWERS.items() if all(getattr(cfg, f) == x for f, x in v.items())]
        if not kinds or layer.attention.causal:
            raise ValueError("a tower neither CLIP's nor SigLIP's (see TOWERS)")
        return {
            "model_type": kinds[0],
            "image_size": cfg.image_size,
            "patch_size": cfg.patch_size,
            "num_channels": cfg.num_channels,
            "hidden_size": cfg.dim,
            "num_hidden_layers": cfg.transformer.num_layers,
            "num_attention_heads": layer.attention.num_heads,
            "intermediate_size": ffn.hidden_dim,
            "hidden_act": hf_activation(ffn.activation),
            "layer_norm_eps": cfg.norm.eps,
        }

    def __init__(self, cfg: Config, *, parent=None):
        super().__init__(cfg, parent=parent)
        if cfg.image_size % cfg.patch_size:
            raise cfg.field_error(
                "patch_size", f"{cfg.patch_size} does not divide image_size={cfg.image_size}"
            )
        if cfg.pre_norm:
            self._add_child("pre_norm", cfg.norm.clone(input_dim=cfg.dim))
        self._add_child("transformer", cfg.transformer.clone(input_dim=cfg.dim))
        self._add_child("post_norm", cfg.norm.clone(input_dim=cfg.dim))

    @property
    def num_tokens(self) -> int:
        cfg = self._config
        return (cfg.image_size // cfg.patch_size) ** 2 + int(cfg.class_token)

    def _create_layer_parameter_specs(self) -> dict[str, ParameterSpec]:
        cfg, init = self._config, jax.nn.initializers.normal(0.02)
        patch = (cfg.dim, cfg.num_channels, cfg.patch_size, cfg.patch_size)
        specs = {
            # A stride-`patch_size` convolution's weight, in its own layout.
            "patch_weight": ParameterSpec(patch, self.dtype, ("embed", None, None, None), init),
            "position_embedding": ParameterSpec(
                (self.num_tokens, cfg.dim), self.dtype, (None, "embed"), init
            ),
        }
        if cfg.patch_bias:
            specs["patch_bias"] = ParameterSpec((cfg.dim,), self.dtype, ("embed",), init)
        if cfg.class_token:
            specs["class_embedding"] = ParameterSpec((cfg.dim,), self.dtype, ("embed",), init)
        return specs

    def forward(self, pixels: jax.Array) -> tuple[jax.Array, jax.Array]:
        cfg = self._config
        weight = self.parameters["patch_weight"]
        x = patchify(pixels.astype(self.dtype), cfg.patch_size) @ weight.reshape(cfg.dim, -1).T
        if cfg.patch_bias:
            x = x + self.parameters["patch_bias"]
        if cfg.class_token:
            cls = jnp.broadcast_to(self.parameters["class_embedding"], (x.shape[0], 1, cfg.dim))
            x = jnp.concatenate([cls.astype(x.dtype), x], axis=1)
        x = x + self.parameters["position_embedding"].astype(x.dtype)
        if cfg.pre_norm:
            x = self.pre_norm(x)
        positions = jnp.broadcast_to(jnp.arange(x.shape[1]), x.shape[:2])
        x = self.transformer(x, positions=positions)
        if cfg.post_norm_all:
            x = self.post_norm(x)
        pooled = x[:, 0] if cfg.class_token else jnp.mean(x, axis=1)
        return x, pooled if cfg.post_norm_all else self.post_norm(pooled)
