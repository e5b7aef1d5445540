"""Preference optimization for axplug: DPO, IPO and SimPO on prepared preference pairs."""

from axplug_dpo.data import PreferenceEncoder, PreferenceInput
from axplug_dpo.loss import LOSSES, preference_loss, sequence_logps
from axplug_dpo.model import DPOCausalLM
from axplug_dpo.modifier import DPOModifier

__all__ = [
    "DPOCausalLM",
    "DPOModifier",
    "LOSSES",
    "PreferenceEncoder",
    "PreferenceInput",
    "preference_loss",
    "sequence_logps",
]
