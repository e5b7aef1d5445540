"""Speculative decoding proposers: `Engine(speculative="ngram")`, `axplug serve --speculative
draft:checkpoint=runs/small`; the Engine verifies what they propose (axplug.api.run.Proposer)."""

from axplug_speculative.draft import DraftProposer
from axplug_speculative.ngram import NgramProposer, lookup

__all__ = ["DraftProposer", "NgramProposer", "lookup"]
