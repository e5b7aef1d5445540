"""Prompt lookup (n-gram) proposals: what followed the context's last tokens where they
appeared before (Saxena 2023; vLLM's `ngram`): free to compute, right on repetitive text
(code edits, summaries quoting their source, structured output)."""

from __future__ import annotations

import numpy as np

from axplug.api.config import config_class
from axplug.api.run import Proposer

__all__ = ["NgramProposer", "lookup"]


def lookup(context: list[int], count: int, max_n: int, min_n: int = 1) -> list[int]:
    """Up to `count` tokens that followed the latest earlier occurrence of the context's last
    n tokens, for the longest n from `max_n` down to `min_n` that occurs; [] if none does."""
    tokens = np.asarray(context, np.int64)
    for n in range(min(max_n, len(tokens) - 1), min_n - 1, -1):
        windows = np.lib.stride_tricks.sliding_window_view(tokens[:-1], n)
        found = np.flatnonzero((windows == tokens[-n:]).all(axis=1))
        if found.size:  # the latest: the nearest repetition predicts best
            start = int(found[-1]) + n
            return tokens[start : start + count].tolist()
    return []


class NgramProposer(Proposer):
    """Proposes what followed the row's last `max_n`..`min_n` tokens earlier in its context."""

    @config_class
    class Config(Proposer.Config):
        max_n: int = 4  # the longest suffix looked up
        min_n: int = 2  # the shortest (1 matches often, and is often wrong)

    @classmethod
    def check_config(cls, cfg) -> None:
        super().check_config(cfg)
        if not (isinstance(cfg.min_n, int) and 1 <= cfg.min_n <= cfg.max_n):
            raise cfg.field_error("min_n", f"must be in [1, max_n={cfg.max_n}], not {cfg.min_n!r}")

    def __init__(self, cfg):
        super().__init__(cfg)
        type(self).check_config(cfg)

    def propose(self, contexts: dict[int, list[int]], limits: dict[int, int]) -> dict[int, list]:
        cfg = self._config
        return {
            row: lookup(ctx, limits[row], cfg.max_n, cfg.min_n) for row, ctx in contexts.items()
        }
