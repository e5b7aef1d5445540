"""Multi-token prediction for axplug (DeepSeek-V3): `--modifier mtp:depth=D`."""

from axplug_mtp.layer import MTPModule, MultiTokenPredictionLM, mtp_labels, shifted
from axplug_mtp.modifier import MTPModifier

__all__ = ["MTPModifier", "MTPModule", "MultiTokenPredictionLM", "mtp_labels", "shifted"]
