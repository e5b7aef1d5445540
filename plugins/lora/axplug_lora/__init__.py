"""LoRA for axplug: the `lora_adapter` layer, the `lora` modifier, `axplug export-lora`, and
adapter tables that serve many adapters over one base (`axplug serve --lora`)."""

from axplug_lora.layer import LoRAAdapter
from axplug_lora.modifier import TRAINABLE, LoRAModifier
from axplug_lora.peft import peft_adapter
from axplug_lora.table import AdapterTable, LoRAWeights, lora_weights, read_adapter

__all__ = ["AdapterTable", "LoRAAdapter", "LoRAModifier", "LoRAWeights", "TRAINABLE",
           "lora_weights", "peft_adapter", "read_adapter"]  # fmt: skip
