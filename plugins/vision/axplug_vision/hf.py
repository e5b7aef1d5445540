"""Hugging Face vision towers to `VisionTransformer` configs and parameters."""

from __future__ import annotations

from typing import Any

import numpy as np

from axplug_vision.tower import VisionTransformer

__all__ = ["clip_vision_config", "clip_vision_params"]


def clip_vision_config(hf: dict) -> Any:
    """The `VisionTransformer` config of a `CLIPVisionConfig`'s fields (its `to_dict()`)."""
    cfg = VisionTransformer.default_config().set(
        image_size=hf["image_size"],
        patch_size=hf["patch_size"],
        num_channels=hf.get("num_channels", 3),
        dim=hf["hidden_size"],
        pre_norm=True,
    )
    cfg.norm.eps = hf.get("layer_norm_eps", 1e-5)
    cfg.transformer.num_layers = hf["num_hidden_layers"]
    layer = cfg.transformer.layer
    layer.norm.eps = cfg.norm.eps
    layer.attention.num_heads = hf["num_attention_heads"]
    act = hf.get("hidden_act", "quick_gelu")
    layer.feed_forward.set(
        hidden_dim=hf["intermediate_size"],
        activation={"gelu": "gelu_exact", "gelu_pytorch_tanh": "gelu_tanh"}.get(act, act),
    )
    return cfg


def clip_vision_params(state: dict, num_layers: int) -> dict:
    """`VisionTransformer` parameters from a CLIP vision tower's state dict (numpy arrays):
    `CLIPVisionModel`'s, or a whole model's whose tower is under `vision_model.`."""
    prefix = "vision_model." if "vision_model.pre_layrnorm.weight" in state else ""

    def get(name: str) -> np.ndarray:
        return np.asarray(state[prefix + name], np.float32)

    def linear(name: str) -> dict:
        return {"weight": get(f"{name}.weight").T, "bias": get(f"{name}.bias")}

    def norm(name: str) -> dict:
        return {"scale": get(f"{name}.weight"), "bias": get(f"{name}.bias")}

    layers = {}
    for i in range(num_layers):
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
    return {
        "class_embedding": get("embeddings.class_embedding"),
        "patch_embedding": {"weight": patch.reshape(patch.shape[0], -1).T},
        "position_embedding": get("embeddings.position_embedding.weight"),
        "pre_norm": norm("pre_layrnorm"),
        "transformer": layers,
        "post_norm": norm("post_layernorm"),
    }
