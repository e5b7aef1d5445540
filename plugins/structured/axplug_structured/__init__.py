"""Structured outputs for axplug's Engine and server: text that matches a JSON schema, a regular
expression, one of some choices or a grammar, by masking each step's tokens with llguidance
(`axplug.api.run.Guide`, entry `llguidance` of `axplug.guides`)."""

from axplug_structured.guide import GuidedConstraint, LLGuidanceGuide
from axplug_structured.tokens import llg_tokenizer

__all__ = ["GuidedConstraint", "LLGuidanceGuide", "llg_tokenizer"]
