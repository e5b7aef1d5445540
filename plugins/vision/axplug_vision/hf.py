"""Hugging Face vision towers (CLIP's, SigLIP's) as `VisionTransformer` configs and tensors."""

from __future__ import annotations

from typing import Any

import numpy as np

from axplug.api import HFFields, HFTensor
from axplug.api.config import ConfigError
from axplug.api.interop import linear_tensors, norm_tensors, read_fields, unflatten
from axplug_vision.tower import TOWERS, VisionTransformer

__all__ = [
    "vision_tower_base",
    "vision_tower_config",
    "vision_tower_tensors",
    "vision_tower_params",
]


def vision_tower_base(kind: Any) -> Any:
    """The `VisionTransformer` config of tower `kind` (a vision config's model_type), for its
    layers' `hf_read` to fill in."""
    if kind not in TOWERS:
        raise ConfigError(
            f"vision_config.model_type={kind!r}: not a vision tower axplug-vision reads "
            f"(supported: {', '.join(TOWERS)})"
        )
    return VisionTransformer.default_config().set(**TOWERS[kind])


def vision_tower_config(hf: dict) -> Any:
    """The `VisionTransformer` config of a vision tower's config fields (`to_dict()`)."""
    cfg = vision_tower_base(hf.get("model_type"))
    defaults = VisionTransformer.hf_defaults[hf["model_type"]]
    fields = HFFields(hf, source="vision_config", defaults=defaults,
                      implied=VisionTransformer.hf_implied)  # fmt: skip
    read_fields(cfg, fields)
    unread = fields.unread()
    if unread or fields.problems:
        problems = [
            *fields.problems,
            *(f"{n}={v!r} is read by no layer" for n, v in unread.items()),
        ]
        raise ConfigError("vision_config: " + "; ".join(problems))
    return cfg


def vision_tower_tensors(cfg: Any, param: str, hf: str) -> dict[str, HFTensor]:
    """Every parameter of the tower `cfg` at `param` from the tower's tensors under `hf`
    (`vision_tower.` in LLaVA; no `vision_model.`)."""
    out = {
        f"{param}.patch_weight": HFTensor(f"{hf}embeddings.patch_embedding.weight"),
        f"{param}.position_embedding": HFTensor(f"{hf}embeddings.position_embedding.weight"),
        **norm_tensors(f"{param}.post_norm", f"{hf}post_layernorm", cfg.norm),
    }
    if cfg.patch_bias:
        out[f"{param}.patch_bias"] = HFTensor(f"{hf}embeddings.patch_embedding.bias")
    if cfg.class_token:
        out[f"{param}.class_embedding"] = HFTensor(f"{hf}embeddings.class_embedding")
    if cfg.pre_norm:
        out.update(norm_tensors(f"{param}.pre_norm", f"{hf}pre_layrnorm", cfg.norm))
    for i in range(cfg.transformer.num_layers):
        at, to = f"{param}.transformer.layer{i}", f"{hf}encoder.layers.{i}"
        out.update(
            {
                **norm_tensors(f"{at}.attention_norm", f"{to}.layer_norm1", cfg.norm),
                **norm_tensors(f"{at}.feed_forward_norm", f"{to}.layer_norm2", cfg.norm),
                **linear_tensors(f"{at}.attention.output", f"{to}.self_attn.out_proj", True),
                **linear_tensors(f"{at}.feed_forward.wi_up", f"{to}.mlp.fc1", True),
                **linear_tensors(f"{at}.feed_forward.wo", f"{to}.mlp.fc2", True),
            }
        )
        for n in "qkv":
            out.update(linear_tensors(f"{at}.attention.qkv.{n}", f"{to}.self_attn.{n}_proj", True))
    return out


def vision_tower_params(state: dict, cfg: Any) -> dict:
    """`VisionTransformer` parameters (of `cfg`) from a vision tower's state dict of numpy
    arrays: the tower's own, or a whole model's with the tower under `vision_model.`."""
    prefix = "vision_model." if "vision_model.post_layernorm.weight" in state else ""
    flat = {}
    for path, rule in vision_tower_tensors(cfg, "tower", prefix).items():
        value = np.asarray(state[rule.name], np.float32)
        flat[path.removeprefix("tower.")] = value.T if rule.transpose else value
    return unflatten(flat)
