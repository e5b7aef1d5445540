"""Hugging Face vision towers (CLIP's, SigLIP's) to `VisionTransformer` configs and parameters."""

from __future__ import annotations

from typing import Any

import numpy as np

from axplug.api.config import ConfigError
from axplug.api.layers import HF_ACTIVATIONS
from axplug_vision.tower import VisionTransformer

__all__ = ["TOWERS", "vision_tower_config", "vision_tower_params"]

# model_type -> how the tower differs from the ViT defaults.
TOWERS = {
    # A class token, a pre-norm, the post-norm on the pooled class token only.
    "clip_vision_model": dict(class_token=True, pre_norm=True, post_norm_all=False),
    # No class token, a biased patch embedding, the post-norm on every patch (the attention
    # pooling head, `vision_use_head`, is not read: vision-language models drop it).
    "siglip_vision_model": dict(class_token=False, patch_bias=True, post_norm_all=True),
}


def vision_tower_config(hf: dict) -> Any:
    """The `VisionTransformer` config of a vision tower's config fields (`to_dict()`)."""
    kind = hf.get("model_type")
    if kind not in TOWERS:
        raise ConfigError(
            f"vision_config.model_type={kind!r}: not a vision tower axplug-vision reads "
            f"(supported: {', '.join(TOWERS)})"
        )
    cfg = VisionTransformer.default_config().set(
        image_size=hf["image_size"],
        patch_size=hf["patch_size"],
        num_channels=hf.get("num_channels", 3),
        dim=hf["hidden_size"],
        **TOWERS[kind],
    )
    cfg.norm.eps = hf.get("layer_norm_eps", 1e-5)
    cfg.transformer.num_layers = hf["num_hidden_layers"]
    layer = cfg.transformer.layer
    layer.norm.eps = cfg.norm.eps
    layer.attention.num_heads = hf["num_attention_heads"]
    act = hf.get("hidden_act", "quick_gelu")
    layer.feed_forward.set(
        hidden_dim=hf["intermediate_size"], activation=HF_ACTIVATIONS.get(act, act)
    )
    return cfg


def vision_tower_params(state: dict, cfg: Any) -> dict:
    """`VisionTransformer` parameters (of `cfg`) from a vision tower's state dict of numpy
    arrays: the tower's own, or a whole model's with the tower under `vision_model.`."""
    prefix = "vision_model." if "vision_model.post_layernorm.weight" in state else ""

    def get(name: str) -> np.ndarray:
        return np.asarray(state[prefix + name], np.float32)

    def linear(name: str) -> dict:
        return {"weight": get(f"{name}.weight").T, "bias": get(f"{name}.bias")}

    def norm(name: str) -> dict:
        return {"scale": get(f"{name}.weight"), "bias": get(f"{name}.bias")}

    layers = {}
    for i in range(cfg.transformer.num_layers):
        at = f"encoder.layers.{i}."
        layers[f"layer{i}"] = {
            "attention_norm": norm(at + "layer_norm1"),
            "attention": {
                "qkv": {n: linear(f"{at}self_attn.{n}_proj") for n in "qkv"},
                "output": linear(at + "self_attn.out_proj"),
            },
            "feed_forward_norm": norm(at + "layer_norm2"),
            "feed_forward": {"wi_up": linear(at + "mlp.fc1"), "wo": linear(at + "mlp.fc2")},
        }
    patch = get("embeddings.patch_embedding.weight")  # [dim, channels, patch, patch]
    params: dict[str, Any] = {
        "patch_embedding": {"weight": patch.reshape(patch.shape[0], -1).T},
        "position_embedding": get("embeddings.position_embedding.weight"),
        "transformer": layers,
        "post_norm": norm("post_layernorm"),
    }
    if cfg.patch_bias:
        params["patch_embedding"]["bias"] = get("embeddings.patch_embedding.bias")
    if cfg.class_token:
        params["class_embedding"] = get("embeddings.class_embedding")
    if cfg.pre_norm:
        params["pre_norm"] = norm("pre_layrnorm")
    return params
