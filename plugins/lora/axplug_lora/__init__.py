"""LoRA for axplug: the `lora_adapter` layer, the `lora` modifier and `axplug export-lora`."""

from axplug_lora.layer import LoRAAdapter
from axplug_lora.modifier import TRAINABLE, LoRAModifier
from axplug_lora.peft import peft_adapter

__all__ = ["LoRAAdapter", "LoRAModifier", "TRAINABLE", "peft_adapter"]
