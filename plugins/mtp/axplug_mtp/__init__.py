"""Multi-token prediction for axplug (DeepSeek-V3): `--modifier mtp:depth=D`."""

from axplug_mtp.layer import MTPModule, MultiTokenPredictionLM, mtp_labels, shifted
from axplug_mtp.modifier import MTPModifier
from axplug_mtp.proposer import MTPProposer

__all__ = [
    "MTPModifier",
    "MTPModule",
    "MTPProposer",
    "MultiTokenPredictionLM",
    "mtp_labels",
    "shifted",
]
