"""Uniformly random tokens, deterministic per (seed, step), for benchmarks."""

from __future__ import annotations

import numpy as np

from axplug.config import REQUIRED, Required, config_class
from axplug.input.base import StepInput, field_error

__all__ = ["SyntheticInput"]


class SyntheticInput(StepInput):
    """Random token ids in [0, vocab_size); targets are the inputs shifted by one."""

    @config_class
    class Config(StepInput.Config):
        vocab_size: Required[int] = REQUIRED

    def __init__(self, cfg: Config):
        super().__init__(cfg)
        if cfg.vocab_size < 1:
            raise field_error(cfg, "vocab_size", f"must be >= 1, got {cfg.vocab_size}")

    @property
    def vocab_size(self) -> int:
        return self._config.vocab_size

    def _windows(self, rng: np.random.Generator, rows: slice) -> np.ndarray:
        cfg = self._config
        shape = (cfg.batch_size, cfg.seq_len + 1)
        return rng.integers(0, cfg.vocab_size, size=shape, dtype=np.int32)[rows]
