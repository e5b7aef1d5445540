"""Byte-level language-model batches from a text file (the bundled corpus by default)."""

from __future__ import annotations

import importlib.resources
import os
import pathlib

import numpy as np

from axplug.config import ConfigFileError, config_class
from axplug.input.base import StepInput, check_split, field_error

__all__ = ["ByteTextInput", "bundled_corpus_path"]


def bundled_corpus_path() -> pathlib.Path:
    """Path of the public-domain text shipped with axplug (see `data/SOURCE.md`)."""
    return pathlib.Path(str(importlib.resources.files("axplug.input").joinpath("data/corpus.txt")))


class ByteTextInput(StepInput):
    """Random windows of a file's bytes (vocab 256); targets are the inputs shifted by one.

    The last `eval_fraction` of the file is held out: `split="eval"` samples only from it and
    `split="train"` only from the rest, so no window crosses the boundary.
    """

    vocab_size = 256

    @config_class
    class Config(StepInput.Config):
        path: str | None = None  # None: the bundled corpus
        split: str = "train"
        eval_fraction: float = 0.05

    def __init__(self, cfg: Config):
        super().__init__(cfg)
        check_split(cfg)
        path = bundled_corpus_path() if cfg.path is None else pathlib.Path(cfg.path)
        if not path.is_file():
            raise cfg.field_error(
                "path",
                f"file {str(path)!r} does not exist; set path to a text file, or to None for "
                "the bundled corpus",
                ConfigFileError,
            )
        size = os.path.getsize(path)
        eval_start = size - int(size * cfg.eval_fraction)
        lo, hi = (0, eval_start) if cfg.split == "train" else (eval_start, size)
        need = cfg.seq_len + 1
        if hi - lo < need:
            raise field_error(
                cfg,
                "seq_len",
                f"the {cfg.split} split of {str(path)!r} has {hi - lo} bytes, fewer than "
                f"seq_len + 1 = {need}; use a smaller seq_len or a larger file",
            )
        self._file = path
        # Memory-mapped: a large file is paged in on demand, not read whole.
        self._data = np.memmap(path, dtype=np.uint8, mode="r")[lo:hi]

    @property
    def data(self) -> np.ndarray:
        """The bytes this split samples from (read-only uint8)."""
        return self._data

    def _windows(self, rng: np.random.Generator, rows: slice) -> np.ndarray:
        cfg = self._config
        offsets = rng.integers(0, len(self._data) - cfg.seq_len, size=cfg.batch_size)[rows]
        return self._data[offsets[:, None] + np.arange(cfg.seq_len + 1)]

    @staticmethod
    def encode(text: str) -> np.ndarray:
        """UTF-8 bytes of `text` as int32 token ids."""
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int32)

    @staticmethod
    def decode(ids) -> str:
        """Token ids back to text; invalid UTF-8 becomes U+FFFD."""
        return bytes(np.asarray(ids, dtype=np.uint8).tolist()).decode("utf-8", errors="replace")
