"""A weighted mixture of prepared data directories, a pure function of `(seed, step)`.

Rows of the global batch stream are dealt out in blocks of `BLOCK` rows: each source gets
its quota of every block (`weights` times the block, rounded by largest remainder, so the
shares are exact over every block), at positions a seeded permutation of the block picks.
Row `n` is then source `i`'s sample `k`, where `k` counts source `i`'s rows before `n`; a
source serves its samples as `TokenFileInput` does (its own windows, epochs and shuffle),
so a small source with a large weight repeats, epoch by epoch. A resumed run sees the same
rows, and the tokens served per source up to any step are known in closed form (`metrics`).
"""

from __future__ import annotations

import logging
import re
from typing import Any

import numpy as np

from axplug.api.config import ConfigFileError, config_class
from axplug.api.data import (
    Batch,
    StepInput,
    TokenFileInput,
    check_split,
    check_step,
    field_error,
    prefetched,
)

__all__ = ["MixtureInput", "BLOCK", "quotas"]

log = logging.getLogger("axplug.input")
BLOCK = 1000  # rows per block of the mixture's schedule
_NAME = re.compile(r"[A-Za-z0-9_.-]+")


def _tokenizer(meta: dict) -> tuple:
    """(tokenizer file sha256 or None, eos id, bos id) of a data directory's meta.json."""
    return meta.get("settings", {}).get("tokenizer_sha256"), meta.get("eos_id"), meta.get("bos_id")


def _describe(tokenizer: tuple) -> str:
    sha, eos, bos = tokenizer
    return ", ".join(filter(None, [sha and f"sha256 {sha[:12]}", f"eos {eos}", f"bos {bos}"]))


def quotas(weights: list[float], rows: int) -> np.ndarray:
    """Rows per source in a block of `rows`: the weights' shares, rounded by largest
    remainder (ties to the earlier source), summing to `rows`."""
    w = np.asarray(weights, np.float64) / np.sum(weights)
    exact = w * rows
    out = np.floor(exact).astype(np.int64)
    order = sorted(range(len(w)), key=lambda i: (-(exact[i] - out[i]), i))
    out[order[: rows - int(out.sum())]] += 1
    return out


class MixtureInput(StepInput):
    """Batches drawn from several prepared data directories (`sources`, paths or storage
    URLs) in proportion to `weights`, or to each source's tokens times its `epochs`.

    Each source is a `TokenFileInput` with this input's `seq_len`, `split`, `eval_fraction`,
    `packing`, `rows` and `storage_options`, and its own seed (`seed` + its index); they
    must share a tokenizer (its vocabulary, its file's sha256 and special ids, from each
    meta.json; `mixed_tokenizers=True` allows others of one vocabulary size). `names` label
    the metrics `data/tokens/NAME` (tokens served from each source so far, over every process)
    and `data/share/NAME`.
    """

    @config_class
    class Config(StepInput.Config):
        sources: list[str] = []
        weights: list[float] = []
        epochs: list[float] = []  # instead of weights: passes over each source per pass
        names: list[str] = []
        split: str = "train"
        eval_fraction: float = 0.05
        packing: bool = False
        rows: str = "stream"
        mixed_tokenizers: bool = False  # allow sources of different tokenizers of one size
        storage_options: dict[str, Any] = {}
        prefetch: int = 2

    def _check_tokenizers(self, cfg: Config) -> int:
        """The sources' one vocabulary size; sources of other tokenizers are refused."""
        paths = list(zip(cfg.sources, self.sources, strict=True))
        if len({s.vocab_size for s in self.sources}) > 1:
            sizes = ", ".join(f"{p} {s.vocab_size}" for p, s in paths)
            raise cfg.field_error("sources", f"tokenizers of different vocabularies ({sizes}); "
                                  "prepare every source with the same tokenizer",
                                  ConfigFileError)  # fmt: skip
        seen = {p: _tokenizer(s.meta) for p, s in paths}
        if any(t[0] is None for t in seen.values()):  # prepared before meta.json held the hash
            old = [p for p, t in seen.items() if t[0] is None]
            log.warning(
                "mixture: %s record no tokenizer hash: their tokenizer is compared by "
                "vocabulary size only (prepare them again to check it)",
                ", ".join(old),
            )
            seen = {p: (None, *t[1:]) for p, t in seen.items()}
        if len(set(seen.values())) > 1 and not cfg.mixed_tokenizers:
            which = ", ".join(f"{p} ({_describe(t)})" for p, t in seen.items())
            raise cfg.field_error("sources", f"sources of different tokenizers of one size: "
                                  f"{which}; prepare every source with the same tokenizer, or "
                                  "set mixed_tokenizers=True if their ids mean the same",
                                  ConfigFileError)  # fmt: skip
        return self.sources[0].vocab_size

    @classmethod
    def vocab_size_of(cls, cfg: Config) -> int | None:
        """The sources' tokenizer vocabulary (the first's; `__init__` checks they agree)."""
        if not cfg.sources:
            return None
        return TokenFileInput.vocab_size_of(_source_config(cfg, 0))

    @classmethod
    def tokenizer_dir_of(cls, cfg: Config) -> str | None:
        """The first source's directory: the sources share one tokenizer."""
        return str(cfg.sources[0]) if cfg.sources else None

    def __init__(self, cfg: Config):
        super().__init__(cfg)
        check_split(cfg)
        if len(cfg.sources) < 1:
            raise field_error(cfg, "sources", "give the prepared data directories to mix, e.g. "
                              "sources=['data/web','data/code'],weights=[0.7,0.3]")  # fmt: skip
        n = len(cfg.sources)
        if bool(cfg.weights) == bool(cfg.epochs):
            raise field_error(cfg, "weights", f"give either weights or epochs, one per source "
                              f"({n}), not {'both' if cfg.weights else 'neither'}")  # fmt: skip
        given = "weights" if cfg.weights else "epochs"
        values = list(cfg.weights or cfg.epochs)
        if len(values) != n or any(not v >= 0 for v in values) or sum(values) <= 0:
            raise field_error(cfg, given, f"{values}: one number >= 0 per source ({n}), "
                              "not all 0")  # fmt: skip
        names = list(cfg.names) or [f"source{i}" for i in range(n)]
        if len(names) != n or len(set(names)) != n or not all(map(_NAME.fullmatch, names)):
            raise field_error(cfg, "names", f"{names}: {n} distinct names of letters, digits, "
                              "'_', '.' or '-'")  # fmt: skip
        if cfg.prefetch < 0:
            raise field_error(cfg, "prefetch", f"{cfg.prefetch}: must be >= 0")
        self.names = names
        self.sources = [_source_config(cfg, i).instantiate() for i in range(n)]
        self.vocab_size = self._check_tokenizers(cfg)
        if cfg.epochs:  # a source's rows per pass, times its passes
            values = [e * s.num_windows for e, s in zip(cfg.epochs, self.sources, strict=True)]
        self.weights = np.asarray(values, np.float64) / np.sum(values)
        self.quota = quotas(list(self.weights), BLOCK)
        self._block: tuple[int, np.ndarray, np.ndarray] | None = None

    def _schedule(self, block: int) -> tuple[np.ndarray, np.ndarray]:
        """(source, rank among that source's rows of the block) of each row of `block`."""
        cached = self._block  # one read: prefetching threads may replace it meanwhile
        if cached is None or cached[0] != block:
            slots = np.repeat(np.arange(len(self.quota)), self.quota)
            rng = np.random.default_rng([self._config.seed, 0x6D6978, block])
            slots = slots[rng.permutation(BLOCK)]
            rank = np.zeros(BLOCK, np.int64)
            for i in range(len(self.quota)):
                mine = slots == i
                rank[mine] = np.arange(int(mine.sum()))
            cached = self._block = (block, slots, rank)
        return cached[1], cached[2]

    def sample_of(self, row: int) -> tuple[int, int]:
        """(source, that source's sample index) of global row `row`."""
        block, at = divmod(row, BLOCK)
        slots, rank = self._schedule(block)
        source = int(slots[at])
        return source, block * int(self.quota[source]) + int(rank[at])

    def batch(self, step: int) -> Batch:
        check_step(step)
        cfg = self._config
        first = int(step) * cfg.batch_size + cfg.process_index * self.local_batch_size
        picks = [self.sample_of(r) for r in range(first, first + self.local_batch_size)]
        parts: dict[int, tuple[list[int], Batch]] = {}
        for i in sorted({s for s, _ in picks}):
            where = [r for r, (s, _) in enumerate(picks) if s == i]
            parts[i] = (where, self.sources[i].rows([picks[r][1] for r in where]))
        keys = next(iter(parts.values()))[1].keys()
        batch = {}
        for key in keys:
            first_part = parts[next(iter(parts))][1][key]
            out = np.empty((len(picks), *first_part.shape[1:]), first_part.dtype)
            for where, rows in parts.values():
                out[where] = rows[key]
            batch[key] = out
        return batch

    def iter_from(self, step: int):
        return prefetched(self.batch, step, self._config.prefetch)

    def rows_before(self, step: int) -> np.ndarray:
        """Rows each source served to every process in the steps before `step`."""
        total = step * self._config.batch_size
        blocks, rest = divmod(total, BLOCK)
        out = blocks * self.quota
        if rest:
            slots, _ = self._schedule(blocks)
            out = out + np.bincount(slots[:rest], minlength=len(self.quota))
        return out

    def metrics(self, step: int) -> dict[str, float]:
        rows = self.rows_before(step)
        tokens = rows * self._config.seq_len
        out = {f"data/tokens/{n}": float(t) for n, t in zip(self.names, tokens, strict=True)}
        share = rows / max(int(rows.sum()), 1)
        out.update({f"data/share/{n}": float(s) for n, s in zip(self.names, share, strict=True)})
        return out

    def _windows(self, rng, rows):
        """Unused: `batch` takes each source's rows instead of drawing random windows."""
        raise NotImplementedError("MixtureInput.batch does not draw random windows")


def _source_config(cfg: MixtureInput.Config, index: int) -> TokenFileInput.Config:
    """Source `index`'s token-file config: the mixture's shape, its own seed."""
    return TokenFileInput.default_config().set(
        path=cfg.sources[index], seq_len=cfg.seq_len, batch_size=cfg.batch_size,
        seed=cfg.seed + index, split=cfg.split, eval_fraction=cfg.eval_fraction,
        packing=cfg.packing, rows=cfg.rows, storage_options=cfg.storage_options, prefetch=0,
    )  # fmt: skip
