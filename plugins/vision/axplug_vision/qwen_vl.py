"""Qwen2.5-VL (`Qwen2_5_VLForConditionalGeneration`): Qwen2.5-VL's windowed vision tower, whose
merger gives the text width (no projector), and the Qwen2 text family (`qwen2_5_vl_text` is
its layout) with multimodal rotary positions."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from axplug.api import HFFields, HFTensor
from axplug.api.interop import HFImportError
from axplug_vision.model import VisionLanguageModel, text_architecture
from axplug_vision.qwen_hf import qwen_tower_tensors
from axplug_vision.qwen_rope import MultimodalRotaryTransform
from axplug_vision.qwen_tower import QwenVisionTower

__all__ = ["Qwen2_5_VL"]

TEXT_FAMILY = "qwen2"
# transformers' Qwen2_5_VLTextConfig values where they differ from Qwen2's, for the fields a
# config.json leaves out.
TEXT_DEFAULTS = dict(
    vocab_size=152_064, hidden_size=8192, intermediate_size=29_568, num_hidden_layers=80,
    num_attention_heads=64, num_key_value_heads=8, rms_norm_eps=1e-5, rope_theta=1e6,
    use_sliding_window=False, sliding_window=4096, max_window_layers=80,
)  # fmt: skip
# The text model's fields (transformers' Qwen2_5_VLTextConfig's) that the Hub's checkpoints
# keep at the top level of config.json, from before transformers 5's `text_config`.
FLAT_TEXT_FIELDS = (
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "hidden_act", "max_position_embeddings", "rms_norm_eps",
    "use_sliding_window", "sliding_window", "max_window_layers", "layer_types",
    "attention_dropout", "rope_parameters", "rope_scaling", "rope_theta",
)  # fmt: skip


def nest_text_fields(fields: HFFields) -> None:
    """A flat config.json's text fields read as its `text_config`, as transformers does; where
    it has a `text_config`, transformers ignores them, and so does this."""
    flat = {name: fields.raw[name] for name in FLAT_TEXT_FIELDS if name in fields.raw}
    fields.read.update(flat)
    if "text_config" not in fields.raw:
        tied = {"tie_word_embeddings": fields.raw.get("tie_word_embeddings", False)}
        fields.raw["text_config"] = {**flat, **tied, "model_type": "qwen2_5_vl_text"}


class Qwen2_5_VL:
    """Qwen2_5_VLForConditionalGeneration, named as transformers 5 saves it and the Hub's
    checkpoints are (`model.`, `lm_head.`, `visual.`); its modules' names (`model.
    language_model.`, `model.visual.`) read too. Images only: videos are not read."""

    architecture = "Qwen2_5_VLForConditionalGeneration"
    model_type = "qwen2_5_vl"
    defaults: Mapping[str, Any] = {
        "image_token_id": 151_655,
        "video_token_id": 151_656,
        "vision_start_token_id": 151_652,
        "vision_end_token_id": 151_653,
        "tie_word_embeddings": False,
    }
    aliases: Mapping[str, str] = {}
    implied: Mapping[str, Any] = {}
    checkpoint_prefixes: Mapping[str, str] = {
        "model.language_model.": "model.",
        "model.visual.": "visual.",
    }

    def base_config(self, fields: HFFields) -> Any:
        arch = text_architecture(TEXT_FAMILY)
        if arch is None:
            raise HFImportError(
                f"{fields.source}: cannot import a {self.architecture}: its text model is the "
                "Qwen2 family's (Qwen2ForCausalLM), which no installed plugin has "
                "(install axplug-models)"
            )
        nest_text_fields(fields)
        # The view every later reader of `text_config` gets: its own defaults, Qwen2's names.
        text = fields.within("text_config", defaults={**arch.defaults, **TEXT_DEFAULTS},
                             aliases=arch.aliases, implied=arch.implied)  # fmt: skip
        cfg = arch.base_config(text)
        decoder = cfg.model.decoder
        decoder.transformer.layer.attention.position = MultimodalRotaryTransform.default_config()
        fields.get("video_token_id")  # a video's placeholder: videos are not read
        fields.get("vision_token_id", None)  # in the Hub's configs, used by no code
        cfg.model = VisionLanguageModel.default_config().set(
            decoder=decoder,
            vision=QwenVisionTower.default_config(),
            projector=None,
            text_family=TEXT_FAMILY,
            # What Qwen2.5-VL's processor puts around an image's placeholders in a prompt.
            image_begin_id=fields.positive_int("vision_start_token_id"),
            image_end_id=fields.positive_int("vision_end_token_id"),
            rope_axes=3,  # a prompt's tokens carry (time, height, width) rotary positions
        )
        return cfg

    def tensors(self, model: Any) -> dict[str, HFTensor]:
        return {
            **text_architecture(TEXT_FAMILY).tensors(model),
            **qwen_tower_tensors(model.vision, "vision", "visual."),
        }

    def config_fields(self, model: Any) -> dict[str, Any]:
        # Any model may be asked (an export tries each architecture): a text model has none.
        ids = (getattr(model, "image_begin_id", None), getattr(model, "image_end_id", None))
        return {"vision_start_token_id": ids[0], "vision_end_token_id": ids[1]}
