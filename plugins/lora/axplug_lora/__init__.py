"""LoRA for axplug: the `lora_linear` layer, the `lora` modifier and `axplug export-lora`."""

from axplug_lora.layer import LoRALinear
from axplug_lora.modifier import TRAINABLE, LoRAModifier
from axplug_lora.peft import peft_adapter

__all__ = ["LoRALinear", "LoRAModifier", "TRAINABLE", "peft_adapter"]
