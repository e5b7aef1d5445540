"""Gemma 3 (`Gemma3ForConditionalGeneration`): a SigLIP tower, Gemma 3's pooling projector and
the Gemma 3 text family (`gemma3_text`), an image's tokens attending to each other both ways."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import jax

from axplug.api import HFFields, HFTensor
from axplug.api.config import REQUIRED, Required, config_class
from axplug.api.interop import norm_tensors
from axplug.api.layers import BaseLayer, Linear, RMSNorm
from axplug_vision.hf import vision_tower_tensors
from axplug_vision.llava import Llava

__all__ = ["Gemma3", "Gemma3Projector"]


class Gemma3Projector(BaseLayer):
    """Gemma 3's projector: a square grid of patch features [images, patches, input_dim],
    average-pooled to `tokens_per_image`, (1 + w) RMS-normed, then projected (no bias) to
    [images, tokens_per_image, output_dim]."""

    hf_reads_subtree = True
    hf_writes_subtree = True

    @config_class
    class Config(BaseLayer.Config):
        input_dim: Required[int] = REQUIRED
        output_dim: Required[int] = REQUIRED
        # A square number: the pooled grid's side is its root.
        tokens_per_image: Required[int] = REQUIRED
        norm: RMSNorm.Config = RMSNorm.default_config().set(scale_offset=1.0)
        projection: Linear.Config = Linear.default_config().set(mesh_axes=(None, "embed"))

    @classmethod
    def hf_read(cls, cfg: Config, fields) -> None:
        cfg.tokens_per_image = fields.positive_int("mm_tokens_per_image")
        # The norm is over the tower's width, with the tower's epsilon.
        cfg.norm.eps = fields.within("vision_config").number("layer_norm_eps")

    @classmethod
    def hf_write(cls, cfg: Config) -> dict:
        return {"mm_tokens_per_image": cfg.tokens_per_image}

    def __init__(self, cfg: Config, *, parent=None):
        super().__init__(cfg, parent=parent)
        if math.isqrt(cfg.tokens_per_image) ** 2 != cfg.tokens_per_image:
            raise cfg.field_error(
                "tokens_per_image", f"{cfg.tokens_per_image} is not a square number (16, 256)"
            )
        self._add_child("norm", cfg.norm.clone(input_dim=cfg.input_dim))
        self._add_child(
            "projection",
            cfg.projection.clone(input_dim=cfg.input_dim, output_dim=cfg.output_dim, bias=False),
        )

    def forward(self, features: jax.Array) -> jax.Array:
        cfg = self._config
        images, patches, dim = features.shape
        side, pooled = math.isqrt(patches), math.isqrt(cfg.tokens_per_image)
        if side * side != patches or side % pooled:
            raise cfg.field_error(
                "tokens_per_image",
                f"{cfg.tokens_per_image} does not pool a {side}x{side} grid of {patches} "
                f"patches; give a square whose root divides {side}",
            )
        kernel = side // pooled
        grid = features.astype("float32").reshape(images, pooled, kernel, pooled, kernel, dim)
        means = grid.mean(axis=(2, 4)).reshape(images, cfg.tokens_per_image, dim)
        return self.projection(self.norm(means.astype(features.dtype)))


class Gemma3(Llava):
    """Gemma3ForConditionalGeneration, named as transformers 5 saves it (as LLaVA:
    `language_model.model.`, `vision_tower.`, `multi_modal_projector.`); the names of
    transformers' own modules and of the Hub's older checkpoints read too."""

    architecture = "Gemma3ForConditionalGeneration"
    model_type = "gemma3"
    defaults: Mapping[str, Any] = {
        "mm_tokens_per_image": 256,
        "boi_token_index": 255_999,
        "eoi_token_index": 256_000,
        "image_token_index": 262_144,
        "tie_word_embeddings": True,
    }
    # Gemma 3's placeholders per image are the pooled tokens.
    aliases: Mapping[str, str] = {
        "image_token_id": "image_token_index",
        "image_seq_length": "mm_tokens_per_image",
    }

    def base_config(self, fields: HFFields) -> Any:
        cfg = super().base_config(fields)
        cfg.model.set(
            projector=Gemma3Projector.default_config(),
            bidirectional_images=True,
            # What Gemma 3's processor puts around an image's placeholders in a prompt.
            image_begin_id=fields.get("boi_token_index"),
            image_end_id=fields.get("eoi_token_index"),
            image_marked_by_begin=True,
            image_text_around="\n\n",
        )
        return cfg

    def tensors(self, model: Any) -> dict[str, HFTensor]:
        hf = "multi_modal_projector."
        return {
            **self._text_rules(model),
            **vision_tower_tensors(model.vision, "vision", "vision_tower."),
            # Stored [input, output]: a matmul weight, not an nn.Linear's.
            "projector.projection.weight": HFTensor(f"{hf}mm_input_projection_weight"),
            **norm_tensors("projector.norm", f"{hf}mm_soft_emb_norm", model.projector.norm),
        }

    def ignored_tensors(self, model: Any) -> tuple[str, ...]:
        return ()  # the tower is whole: Gemma 3 takes its last layer's features

    def config_fields(self, model: Any) -> dict[str, Any]:
        # None of LLaVA's: Gemma 3 has no feature layer or strategy to choose.
        ids = (getattr(model, "image_begin_id", None), getattr(model, "image_end_id", None))
        return {"boi_token_index": ids[0], "eoi_token_index": ids[1]}
