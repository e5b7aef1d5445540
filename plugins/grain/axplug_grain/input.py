"""`GrainInput`: batches of token documents read by a Grain pipeline, resumable by state.

    MapDataset.source(documents of the ArrayRecord / Parquet files)
      [split]                 the last `eval_fraction` of the documents are the eval split
      [process_index::process_count]   each process reads its own documents
      .shuffle(seed).repeat()          a new global permutation every epoch (shuffle=True)
      .to_iter_dataset()               read ahead by `read_threads` threads
      PackedWindowsIterDataset         the token-file input's stream windows
      .batch(batch_size // process_count)
      [.mp_prefetch(worker_count)]

Unlike `TokenFileInput`, batches are not a function of the step: where the stream is at
step N depends on the lengths of the documents before it. A resumed run continues from the
Grain iterator's state saved with the checkpoint (`state_at` / `restore_state`); without
one, `iter_from(N)` replays the N batches before it (exact, but slow for a large N).
"""

from __future__ import annotations

import collections
import copy
import json
import logging
import os
from collections.abc import Iterator

import grain
import numpy as np

from axplug.api.config import REQUIRED, ConfigFileError, ConfigValueError, Required, config_class
from axplug.api.data import Batch, Input
from axplug_grain.packing import PackedWindowsIterDataset
from axplug_grain.sources import DocumentSource, resolve_paths

__all__ = ["GrainInput", "STATE_FORMAT"]

log = logging.getLogger("axplug_grain")

STATE_FORMAT = "axplug-grain-1"
_KEPT_STATES = 64  # iterator states of the most recent steps, for `state_at`


class GrainInput(Input):
    """Token documents from ArrayRecord or Parquet files through a Grain pipeline, packed
    into stream windows like `TokenFileInput`; resumes from the iterator's saved state.

    The pipeline is the module's docstring.

    `batch_size` is the global batch: process `process_index` of `process_count` reads every
    `process_count`-th document of the split and yields `batch_size // process_count` rows.
    """

    @config_class
    class Config(Input.Config):
        paths: Required[list[str] | str] = REQUIRED  # .array_record/.parquet files, globs
        field: str = "tokens"  # the record key / column holding the token ids
        vocab_size: Required[int] = REQUIRED  # every id must be below it
        seq_len: int = 256
        batch_size: int = 8
        seed: int = 0
        shuffle: bool = True  # a global permutation of the documents, new every epoch
        packing: bool = True  # segment_ids, positions, no targets across documents
        split: str = "train"
        eval_fraction: float = 0.05  # the last documents (at least one) are the eval split
        process_index: int = 0
        process_count: int = 1
        worker_count: int = 0  # Grain worker processes (0: read in this process)
        read_threads: int = 4  # threads reading documents ahead

    def __init__(self, cfg: Config):
        super().__init__(cfg)
        self._check(cfg)
        paths = [cfg.paths] if isinstance(cfg.paths, str) else list(cfg.paths)
        try:
            self.files = resolve_paths(paths)
        except FileNotFoundError as e:
            raise cfg.field_error("paths", str(e), ConfigFileError) from None
        self.source = DocumentSource(self.files, cfg.field, cfg.vocab_size)
        n = len(self.source)
        if n < 2:
            raise cfg.field_error(
                "paths",
                f"{self.files} hold {n} document(s): no eval split (the last "
                "eval_fraction of them, at least one); give 2 or more",
                ConfigFileError,
            )
        eval_docs = max(1, int(n * cfg.eval_fraction))
        lo, hi = (0, n - eval_docs) if cfg.split == "train" else (n - eval_docs, n)
        self.documents = len(range(lo + cfg.process_index, hi, cfg.process_count))
        if self.documents < 1:
            raise cfg.field_error(
                "paths",
                f"the {cfg.split} split holds {hi - lo} document(s), none for process "
                f"{cfg.process_index} of {cfg.process_count}",
                ConfigFileError,
            )
        self._range = (lo, hi)
        self._states: collections.OrderedDict[int, dict] = collections.OrderedDict()

    @staticmethod
    def _check(cfg: Config) -> None:
        def bad(name: str, problem: str) -> Exception:
            return cfg.field_error(name, problem, ConfigValueError)

        if not isinstance(cfg.paths, (str, list, tuple)) or not cfg.paths:
            raise bad("paths", f"{cfg.paths!r}: give a list of .array_record/.parquet files")
        if not isinstance(cfg.vocab_size, int) or cfg.vocab_size < 1:
            raise bad("vocab_size", f"must be an int >= 1, got {cfg.vocab_size!r}")
        for name in ("seq_len", "batch_size", "process_count"):
            if getattr(cfg, name) < 1:
                raise bad(name, f"must be >= 1, got {getattr(cfg, name)}")
        if not 0 <= cfg.seed < 2**32:
            raise bad("seed", f"must be in [0, 2**32), got {cfg.seed}")
        if not 0 <= cfg.process_index < cfg.process_count:
            raise bad(
                "process_index",
                f"must be in [0, process_count={cfg.process_count}), got {cfg.process_index}",
            )
        if cfg.batch_size % cfg.process_count:
            raise bad(
                "batch_size",
                f"{cfg.batch_size} is not divisible by process_count={cfg.process_count}; "
                "each process takes batch_size / process_count rows of the global batch",
            )
        if cfg.split not in ("train", "eval"):
            raise bad("split", f"must be 'train' or 'eval', got {cfg.split!r}")
        if not 0.0 < cfg.eval_fraction < 1.0:
            raise bad("eval_fraction", f"must be in (0, 1), got {cfg.eval_fraction}")
        if cfg.worker_count < 0:
            raise bad("worker_count", f"must be >= 0, got {cfg.worker_count}")
        if cfg.read_threads < 1:
            raise bad("read_threads", f"must be >= 1, got {cfg.read_threads}")

    @property
    def local_batch_size(self) -> int:
        """Rows of the global batch that this process produces."""
        return self._config.batch_size // self._config.process_count

    def dataset(self) -> grain.IterDataset:
        """This process's Grain pipeline of batches (the module's docstring)."""
        cfg = self._config
        lo, hi = self._range
        ds = grain.MapDataset.source(self.source)[lo:hi][cfg.process_index :: cfg.process_count]
        if cfg.shuffle:
            ds = ds.shuffle(seed=cfg.seed)  # epoch e: seed + e (Grain's ShuffleMapDataset)
        ds = ds.repeat()  # endless; reseeds the shuffle every epoch
        it = ds.to_iter_dataset(grain.ReadOptions(num_threads=cfg.read_threads))
        # An epoch of empty documents would never fill a row.
        it = PackedWindowsIterDataset(it, cfg.seq_len, cfg.packing, max_empty=self.documents)
        it = it.batch(self.local_batch_size, drop_remainder=True)
        if cfg.worker_count > 0:
            from absl import flags  # Grain's workers read its absl flags: their defaults

            if not flags.FLAGS.is_parsed():
                flags.FLAGS.mark_as_parsed()
            it = it.mp_prefetch(grain.MultiprocessingOptions(num_workers=cfg.worker_count))
        return it

    def _fingerprint(self) -> dict:
        """What a saved state is only valid for: the stream and this process's part of it."""
        cfg = self._config
        keys = ("field", "seq_len", "batch_size", "seed", "shuffle", "packing", "split",
                "eval_fraction", "process_index", "process_count", "worker_count")  # fmt: skip
        out = {k: getattr(cfg, k) for k in keys}
        out["files"] = [os.path.abspath(p) for p in self.files]
        out["documents"] = len(self.source)
        return out

    # --- the stream ------------------------------------------------------------------------

    def iter_from(self, step: int) -> Iterator[tuple[int, Batch]]:
        """Batches from `step`: from the iterator state of `step` when this input has one
        (recorded while iterating, or given by `restore_state`), else replayed from step 0."""
        if isinstance(step, bool) or not isinstance(step, (int, np.integer)) or step < 0:
            raise ConfigValueError(f"iter_from: step must be an int >= 0, got {step!r}")
        return self._iterate(int(step))

    def _iterate(self, step: int) -> Iterator[tuple[int, Batch]]:
        iterator = iter(self.dataset())
        state = self._states.get(step)
        if state is not None:
            iterator.set_state(copy.deepcopy(state))
        elif step > 0:
            log.warning(
                "grain input: no iterator state for step %d (a checkpoint saved without the "
                "input's state?): replaying the %d batches before it from step 0",
                step,
                step,
            )
            for _ in range(step):
                next(iterator)
        self._states.clear()
        self._record(step, iterator.get_state())
        try:
            for batch in iterator:
                # Recorded before the batch is handed out: the trainer may save step + 1 as
                # soon as it has consumed this batch.
                self._record(step + 1, iterator.get_state())
                # A copy: worker processes hand out views of shared memory.
                yield step, {k: np.array(v, np.int32) for k, v in batch.items()}
                step += 1
        finally:
            close = getattr(iterator, "close", None)  # stops Grain's worker processes
            if close is not None:
                close()

    def _record(self, step: int, state: dict) -> None:
        self._states[step] = json.loads(json.dumps(state))  # a copy, and JSON-able
        while len(self._states) > _KEPT_STATES:
            self._states.popitem(last=False)

    # --- checkpointed state ----------------------------------------------------------------

    def state_at(self, step: int) -> dict | None:
        """The iterator state after the batches of steps < `step`, for the checkpoint of
        `step`; None when this input has not been there recently (a resume then replays)."""
        if step == 0:
            state = json.loads(json.dumps(iter(self.dataset()).get_state()))
        else:
            state = self._states.get(step)
        if state is None:
            log.warning(
                "grain input: no iterator state for step %d (kept: steps %s); its checkpoint "
                "will resume by replaying the stream",
                step,
                list(self._states)[:1] + list(self._states)[-1:],
            )
            return None
        return {"format": STATE_FORMAT, "step": step, "config": self._fingerprint(),
                "iterator": copy.deepcopy(state)}  # fmt: skip

    def restore_state(self, step: int, state: dict) -> None:
        """Makes the next `iter_from(step)` continue from `state` (what `state_at(step)`
        returned in the run that saved it). A state of another stream (a changed config or
        data) is refused with a warning: the stream is replayed instead."""
        if not isinstance(state, dict) or state.get("format") != STATE_FORMAT:
            raise ConfigFileError(
                f"grain input: the saved input state of step {step} is not an {STATE_FORMAT} "
                f"state: {str(state)[:200]}"
            )
        if state.get("step") != step:
            raise ConfigFileError(
                f"grain input: the saved input state is of step {state.get('step')}, "
                f"restoring step {step}"
            )
        saved, now = state.get("config"), self._fingerprint()
        if saved != now:
            changed = sorted(k for k in set(saved or {}) | set(now)
                             if (saved or {}).get(k) != now.get(k))  # fmt: skip
            log.warning(
                "grain input: step %d was saved with another stream (%s changed); its state "
                "does not apply, replaying the stream from step 0 instead",
                step,
                ", ".join(changed),
            )
            return
        self._states.clear()
        self._record(step, state["iterator"])
