"""LLaVA (`LlavaForConditionalGeneration`): a CLIP or SigLIP tower, LLaVA's MLP projector and
any installed text family (its `text_config.model_type`, e.g. LLaMA)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from axplug.api import HFFields, HFTensor
from axplug.api.interop import HFImportError, linear_tensors
from axplug_vision.hf import vision_tower_base, vision_tower_tensors
from axplug_vision.model import VisionLanguageModel, text_architecture, text_fields

__all__ = ["Llava", "renamed"]


def renamed(rules: Mapping[str, HFTensor], prefixes: Mapping[str, str]) -> dict[str, HFTensor]:
    """`rules` with each tensor name's first matching prefix replaced."""

    def rename(name: str) -> str:
        old = next((p for p in prefixes if name.startswith(p)), None)
        return name if old is None else prefixes[old] + name[len(old) :]

    return {
        path: HFTensor(**{**vars(rule), "name": rename(rule.name)}) for path, rule in rules.items()
    }


class Llava:
    """LlavaForConditionalGeneration, named as transformers 5 saves it (`language_model.model.`,
    `language_model.lm_head`, `vision_tower.`, `multi_modal_projector.`); the names of
    transformers' own modules and of older checkpoints read too."""

    architecture = "LlavaForConditionalGeneration"
    model_type = "llava"
    defaults: Mapping[str, Any] = {
        "vision_feature_select_strategy": "default",
        "vision_feature_layer": -2,
        "projector_hidden_act": "gelu",
        "multimodal_projector_bias": True,
    }
    aliases: Mapping[str, str] = {"image_token_id": "image_token_index"}
    implied: Mapping[str, Any] = {}
    checkpoint_prefixes: Mapping[str, str] = {
        "model.vision_tower.vision_model.": "vision_tower.",
        "vision_tower.vision_model.": "vision_tower.",
        "model.vision_tower.": "vision_tower.",
        "model.language_model.": "language_model.model.",
        "model.multi_modal_projector.": "multi_modal_projector.",
        "lm_head.": "language_model.lm_head.",
    }

    def base_config(self, fields: HFFields) -> Any:
        text, arch = text_fields(fields)
        if arch is None:
            raise HFImportError(f"{fields.source}: cannot import: {'; '.join(fields.problems)}")
        cfg = arch.base_config(text)
        vision = fields.raw.get("vision_config") or {}
        cfg.model = VisionLanguageModel.default_config().set(
            decoder=cfg.model.decoder, vision=vision_tower_base(vision.get("model_type"))
        )
        return cfg

    def _text_rules(self, model: Any) -> dict[str, HFTensor]:
        rules = text_architecture(model.text_family or model.text_model_type).tensors(model)
        return renamed(
            rules, {"model.": "language_model.model.", "lm_head.": "language_model.lm_head."}
        )

    def tensors(self, model: Any) -> dict[str, HFTensor]:
        projector = {}
        for name in ("linear_1", "linear_2"):
            projector.update(
                linear_tensors(
                    f"projector.{name}", f"multi_modal_projector.{name}", model.projector
                )
            )
        return {
            **self._text_rules(model),
            **vision_tower_tensors(model.vision, "vision", "vision_tower."),
            **projector,
        }

    def ignored_tensors(self, model: Any) -> tuple[str, ...]:
        # The tower's layers past `vision_feature_layer` (read into no parameter).
        return ("vision_tower.encoder.layers.",)

    def config_fields(self, model: Any) -> dict[str, Any]:
        strategy = "default" if getattr(model, "drop_class_token", False) else "full"
        return {"vision_feature_layer": -1, "vision_feature_select_strategy": strategy}
