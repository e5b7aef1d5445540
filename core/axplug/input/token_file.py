"""The input that trains on a prepared data directory (`axplug prepare-data`; its layout and
checks are in `axplug.input.data_dir`)."""

from __future__ import annotations

import functools
import pathlib
from collections.abc import Iterator
from typing import Any

import numpy as np

from axplug.config import REQUIRED, ConfigFileError, Required, config_class
from axplug.input.base import Batch, StepInput, check_split, check_step, field_error
from axplug.input.data_dir import (
    TOKEN_DIR_FORMAT,
    file_array,
    file_size,
    open_shards,
    out_of_vocab,
    read_meta,
    write_shard,
)
from axplug.input.document_rows import plan_rows, row_batch
from axplug.input.prefetch import prefetched
from axplug.input.remote import data_path

__all__ = ["TokenFileInput", "read_meta", "write_shard", "TOKEN_DIR_FORMAT", "IGNORE_LABEL"]

IGNORE_LABEL = -1  # a target the loss skips (CausalLM ignores labels < 0)


def _token_values(shard, name: str, width: int) -> np.ndarray:
    """The float32 per-token values NAME of a shard (`shard_NNNNN.NAME.bin`; `width` of them
    per token, [tokens, width] when more than one), size checked."""
    path = shard.path.with_name(f"{shard.path.stem}.{name}.bin")
    n = len(shard.tokens)
    if not path.is_file() or file_size(path) != 4 * n * width:
        raise ConfigFileError(
            f"{path}: missing or not {width} float32 per token of {shard.path.name} (meta.json "
            f"lists token values {name!r}): write them again with the command that made them"
        )
    values = file_array(path, np.float32, n * width)
    if width == 1:
        return values
    if not isinstance(values, np.ndarray):
        raise ConfigFileError(f"{path}: {width} values per token are read from local disk only")
    return values.reshape(n, width)


def _root(cfg):
    """The data directory of a config: a local path (`~` expanded) or a `RemotePath`."""
    path = cfg.path if "://" in cfg.path else str(pathlib.Path(cfg.path).expanduser())
    return data_path(path, cfg.storage_options)


class TokenFileInput(StepInput):
    """Batches of a prepared data directory, a pure function of `(seed, step)`.

    The split's token stream (its documents in order) is cut into windows of `seq_len + 1`
    tokens starting every `seq_len`; each epoch visits every window once, in a seeded
    permutation of its own, so a resumed run sees the same batches. The last `eval_fraction`
    of the documents (at least one) is the `eval` split, the rest `train`.

    `packing=True` adds `segment_ids` (one per document within a row) and `positions`
    restarting at each document, so attention stays inside a document and a packed row
    computes what its documents would alone; targets across a document boundary are
    `IGNORE_LABEL`. Without packing a window runs across documents (GPT-style).

    `rows="documents"` starts every row at a document instead (`document_rows`): whole
    documents, packed greedily with `packing`, else one per row, padded; each epoch visits
    every row once. `group` rows stay together in the shuffle (2: preference pairs). A data
    directory with loss masks (a chat's assistant turns) ignores the targets they mask.

    `path` may be a storage URL (`s3://bucket/data`, `gs://...`; the backend of its scheme,
    built with `storage_options` over the environment's settings, as checkpoints are): rows are
    read by range requests, `prefetch` batches ahead in threads, so a step does not wait.

    Per-token values a data directory lists in meta.json's `token_values` (files
    `shard_NNNNN.NAME.bin`, float32; e.g. reference log-probabilities written by a plugin)
    are served under NAME aligned with the targets, 0 where a target does not count; an entry
    with `"width": W` has W per token ([batch, seq, W]), one with `"aligned": "inputs"` is
    aligned with the input ids and served whole (an image's pixels at its placeholders).
    """

    @config_class
    class Config(StepInput.Config):
        path: Required[str] = REQUIRED
        split: str = "train"
        eval_fraction: float = 0.05
        packing: bool = False
        rows: str = "stream"  # or "documents"
        group: int = 1  # consecutive rows shuffled as one (rows="documents")
        storage_options: dict[str, Any] = {}  # a URL path's backend options (endpoint, ...)
        prefetch: int = 2  # batches read ahead in threads (0: in the step's own thread)

    @classmethod
    def vocab_size_of(cls, cfg: Config) -> int | None:
        """The data's tokenizer vocabulary, read from its meta.json (None: path unset)."""
        if cfg.path is REQUIRED:
            return None
        return int(read_meta(_root(cfg))["vocab_size"])

    @classmethod
    def tokenizer_dir_of(cls, cfg: Config) -> str | None:
        """The data directory, which holds its tokenizer."""
        return None if cfg.path is REQUIRED else str(cfg.path)

    def __init__(self, cfg: Config):
        super().__init__(cfg)
        check_split(cfg)
        if cfg.prefetch < 0:
            raise field_error(cfg, "prefetch", f"{cfg.prefetch}: must be >= 0")
        root = _root(cfg)
        self.meta = read_meta(root)
        self.vocab_size = int(self.meta["vocab_size"])
        if cfg.rows not in ("stream", "documents"):
            raise field_error(cfg, "rows", f"{cfg.rows!r}: one of 'stream', 'documents'")
        if (
            cfg.group < 1
            or cfg.batch_size % cfg.group
            or (cfg.group > 1 and cfg.rows != "documents")
        ):
            raise field_error(
                cfg, "group", f"{cfg.group}: must be >= 1, divide batch_size ({cfg.batch_size}) "
                "and, above 1, come with rows='documents'"
            )  # fmt: skip
        self._paths, self._shards, starts, doc_starts = [], [], [0], [np.zeros(1, np.int64)]
        self._masks = []
        listed = self.meta.get("token_values", {})
        self._values: dict[str, list[np.ndarray]] = {n: [] for n in listed}
        self._value_specs = {
            n: (int(e.get("width", 1)), e.get("aligned") == "inputs") for n, e in listed.items()
        }
        whole = [n for n, (_, inputs) in self._value_specs.items() if inputs]
        if whole and cfg.rows != "documents":  # a window could start inside an image
            raise field_error(
                cfg, "rows", f"{cfg.rows!r}: {root}'s token values {whole} ride whole "
                "documents (an image's pixels over its tokens); use rows='documents'"
            )  # fmt: skip
        for shard in open_shards(root, self.meta):  # sizes checked against meta.json, docs.npy
            self._paths.append(shard.path)
            self._shards.append(shard.tokens)
            self._masks.append(shard.mask)
            for name, arrays in self._values.items():
                arrays.append(_token_values(shard, name, self._value_specs[name][0]))
            doc_starts.append(shard.docs[1:] + starts[-1])
            starts.append(starts[-1] + len(shard.tokens))
        self._offsets = np.asarray(starts, np.int64)  # global token offset of each shard
        self._doc_starts = np.concatenate(doc_starts)  # [documents + 1]
        n_docs = len(self._doc_starts) - 1
        if n_docs < 2:
            raise field_error(
                cfg,
                "path",
                f"{root} holds {n_docs} document(s): no eval split "
                "(the last eval_fraction of them, at least one); prepare 2 or more",
            )
        eval_docs = max(1, int(n_docs * cfg.eval_fraction))
        boundary = int(self._doc_starts[n_docs - eval_docs])
        lo, hi = (0, boundary) if cfg.split == "train" else (boundary, int(self._offsets[-1]))
        self._lo = lo
        self._rows = None
        self._epoch: tuple[int, np.ndarray] | None = None
        if cfg.rows == "documents":
            first, last = (
                (0, n_docs - eval_docs) if cfg.split == "train" else (n_docs - eval_docs, n_docs)
            )
            first -= first % cfg.group  # a group's rows stay in one split
            last -= last % cfg.group if cfg.split == "train" else 0
            self._rows = plan_rows(self._doc_starts, first, last, cfg.seq_len + 1, cfg.packing)
            self.num_windows = len(self._rows) // cfg.group
            if self.num_windows < 1:
                raise field_error(cfg, "path", f"the {cfg.split} split of {root} has no documents")
            return
        self.num_windows = (hi - lo - 1) // cfg.seq_len
        if self.num_windows < 1:
            raise field_error(
                cfg,
                "seq_len",
                f"the {cfg.split} split of {root} has {hi - lo} tokens, fewer than seq_len + 1 "
                f"= {cfg.seq_len + 1}; use a smaller seq_len, eval_fraction or more data",
            )
        self._epoch: tuple[int, np.ndarray] | None = None

    def _read(self, start: int, length: int, arrays=None, dtype=np.int32) -> np.ndarray:
        """Tokens [start, start + length) of the whole stream, across shards (of `arrays`:
        the masks, a per-token value)."""
        arrays = self._shards if arrays is None else arrays
        out, end = [], start + length
        first = int(np.searchsorted(self._offsets, start, side="right")) - 1
        for i in range(first, len(arrays)):
            lo, hi = max(start, self._offsets[i]), min(end, self._offsets[i + 1])
            if lo >= hi:
                break
            out.append(arrays[i][lo - self._offsets[i] : hi - self._offsets[i]])
        return np.concatenate(out).astype(dtype)

    def _read_masked(self, start: int, length: int) -> tuple[np.ndarray, np.ndarray | None]:
        """(tokens, loss mask or None) of [start, start + length)."""
        mask = self._read(start, length, self._masks) if self.meta.get("loss_mask") else None
        return self._read(start, length), mask

    def _check_ids(self, windows: np.ndarray, starts: list[int]) -> None:
        """Refuses ids outside the vocabulary, which a gather would clamp silently.

        meta.json's `max_token_id` is checked when the directory opens; this catches a shard
        changed since, at the cost of a max over each batch (`axplug data verify` reads all)."""
        bad = (windows < 0) | (windows >= self.vocab_size)  # uint32 ids >= 2**31 wrap negative
        if not bad.any():
            return
        row, col = (int(i) for i in np.argwhere(bad)[0])
        at = starts[row] + col
        shard = int(np.searchsorted(self._offsets, at, side="right")) - 1
        local = at - int(self._offsets[shard])
        token = int(self._shards[shard][local])
        raise ConfigFileError(out_of_vocab(self._paths[shard], token, local, self.vocab_size))

    def _permutation(self, epoch: int) -> np.ndarray:
        cached = self._epoch  # one read: prefetching threads may replace it meanwhile
        if cached is None or cached[0] != epoch:
            rng = np.random.default_rng([self._config.seed, 0x7F4A, epoch])
            cached = self._epoch = (epoch, rng.permutation(self.num_windows))
        return cached[1]

    def window_start(self, sample: int) -> int:
        """Global token offset of the `sample`-th window served (across epochs)."""
        epoch, index = divmod(sample, self.num_windows)
        return self._lo + int(self._permutation(epoch)[index]) * self._config.seq_len

    def batch(self, step: int) -> Batch:
        check_step(step)
        cfg = self._config
        first = int(step) * cfg.batch_size + cfg.process_index * self.local_batch_size
        return self.rows(range(first, first + self.local_batch_size))

    def rows(self, samples) -> Batch:
        """Rows `samples` (indices into the served sequence, across epochs) as one batch."""
        cfg = self._config
        if self._rows is not None:
            return self._document_batch(samples)
        starts = [self.window_start(r) for r in samples]
        windows = np.stack([self._read(s, cfg.seq_len + 1) for s in starts])
        self._check_ids(windows, starts)
        batch = {
            "input_ids": np.ascontiguousarray(windows[:, :-1]),
            "target_labels": np.ascontiguousarray(windows[:, 1:]),
        }
        if cfg.packing:
            index = np.asarray(starts, np.int64)[:, None] + np.arange(cfg.seq_len + 1)
            doc = np.searchsorted(self._doc_starts, index, side="right") - 1  # [b, L + 1]
            same = doc[:, 1:] == doc[:, :-1]
            batch["target_labels"] = np.where(same, batch["target_labels"], IGNORE_LABEL)
            batch["segment_ids"] = (doc[:, :-1] - doc[:, :1] + 1).astype(np.int32)
            batch["positions"] = (index[:, :-1] - self._doc_starts[doc[:, :-1]]).astype(np.int32)
        if self.meta.get("loss_mask"):
            kept = np.stack([self._read(s + 1, cfg.seq_len, self._masks) for s in starts])
            batch["target_labels"] = np.where(kept > 0, batch["target_labels"], IGNORE_LABEL)
        batch = {k: v.astype(np.int32) for k, v in batch.items()}
        for name, arrays in self._values.items():
            # Values aligned with the inputs ride whole documents only (refused above).
            got = np.stack([self._read(s + 1, cfg.seq_len, arrays, np.float32) for s in starts])
            counted = (batch["target_labels"] >= 0).reshape(*got.shape[:2], *[1] * (got.ndim - 2))
            batch[name] = np.where(counted, got, 0.0).astype(np.float32)
        return batch

    def _document_batch(self, samples) -> Batch:
        """Rows `samples` of the served sequence (whole groups of `group` rows per batch)."""
        cfg = self._config
        group = cfg.group
        rows = []
        for r in samples:
            epoch, index = divmod(r // group, self.num_windows)
            rows.append(self._rows[int(self._permutation(epoch)[index]) * group + r % group])
        read = functools.partial(self._read, dtype=np.float32)
        values = {name: (functools.partial(read, arrays=arrays), *self._value_specs[name])
                  for name, arrays in self._values.items()}  # fmt: skip
        batch = row_batch(self._read_masked, self._doc_starts, np.asarray(rows),
                          cfg.seq_len + 1, IGNORE_LABEL, cfg.packing, values)  # fmt: skip
        if int(batch["input_ids"].max(initial=0)) >= self.vocab_size:
            raise ConfigFileError(
                f"{self._config.path}: a token id is outside the vocabulary of "
                f"{self.vocab_size}: check it with `axplug data verify`"
            )
        return {k: v if k in self._values else v.astype(np.int32) for k, v in batch.items()}

    def iter_from(self, step: int) -> Iterator[tuple[int, Batch]]:
        return prefetched(self.batch, step, self._config.prefetch)

    def _windows(self, rng, rows):
        """Unused: `batch` indexes epoch permutations instead of drawing random windows."""
        raise NotImplementedError("TokenFileInput.batch does not draw random windows")
