"""Stream packing as a Grain `IterDataset`: the token-file input's windows, checkpointable.

The documents of the parent (int arrays, in order) are concatenated into one stream, cut
into windows of `seq_len + 1` tokens starting every `seq_len` tokens (consecutive windows
share one token), exactly as `TokenFileInput` cuts its stream. Each window becomes a row:
`input_ids = window[:-1]`, `target_labels = window[1:]`; with `packing`, also `segment_ids`
(1 for the window's first document, 2 for the next...), `positions` (each token's offset in
its document) and targets that cross a document boundary set to `IGNORE_LABEL`.

The iterator's state is the parent's state before the document the next window starts in,
and the offset of that start in the document: a restored iterator reads that document again
and goes on exactly where the saved one was.
"""

from __future__ import annotations

import collections
from typing import Any

import grain
import numpy as np

from axplug.api.config import ConfigFileError
from axplug.api.data import IGNORE_LABEL

__all__ = ["PackedWindowsIterDataset"]


class PackedWindowsIterDataset(grain.IterDataset):
    """Rows of `seq_len` tokens (see the module) from an `IterDataset` of documents."""

    def __init__(
        self, parent: grain.IterDataset, seq_len: int, packing: bool, max_empty: int = 1 << 20
    ):
        super().__init__(parent)
        self._seq_len = seq_len
        self._packing = packing
        self._max_empty = max_empty  # empty documents in a row before giving up

    def __iter__(self) -> _PackedWindowsIterator:
        return _PackedWindowsIterator(
            self._parent.__iter__(), self._seq_len, self._packing, self._max_empty
        )

    def __str__(self) -> str:
        return f"PackedWindowsIterDataset(seq_len={self._seq_len}, packing={self._packing})"


class _PackedWindowsIterator(grain.DatasetIterator):
    def __init__(self, parent: grain.DatasetIterator, seq_len: int, packing: bool, max_empty: int):
        super().__init__(parent)
        self._seq_len = seq_len
        self._packing = packing
        self._max_empty = max_empty
        # (the parent's state before the document, its tokens), from the one the next
        # window starts in; `_offset` tokens of the first are already served.
        self._docs: collections.deque[tuple[Any, np.ndarray]] = collections.deque()
        self._offset = 0
        self._buffered = 0  # tokens in `_docs` from `_offset` on

    def __next__(self) -> dict[str, np.ndarray]:
        length = self._seq_len + 1
        empty = 0
        while self._buffered < length:
            before = self._parent.get_state()
            doc = np.asarray(next(self._parent))  # StopIteration: the source ended
            if len(doc):
                self._docs.append((before, doc))
                self._buffered += len(doc)
                empty = 0
            elif (empty := empty + 1) > self._max_empty:
                raise ConfigFileError(f"{empty - 1} empty documents in a row: no tokens to pack")
        tokens, segments, positions = [], [], []
        need, offset = length, self._offset
        for k, (_, doc) in enumerate(self._docs, 1):
            piece = doc[offset : offset + need]
            tokens.append(piece)
            segments.append(np.full(len(piece), k, np.int32))
            positions.append(np.arange(offset, offset + len(piece), dtype=np.int32))
            need -= len(piece)
            offset = 0
            if not need:
                break
        window = np.concatenate(tokens).astype(np.int32)
        row = {"input_ids": window[:-1], "target_labels": window[1:]}
        if self._packing:
            doc = np.concatenate(segments)
            row["target_labels"] = np.where(doc[1:] == doc[:-1], window[1:], IGNORE_LABEL)
            row["segment_ids"] = doc[:-1]
            row["positions"] = np.concatenate(positions)[:-1]
        # The next window starts `seq_len` tokens on.
        self._offset += self._seq_len
        self._buffered -= self._seq_len
        while self._offset >= len(self._docs[0][1]):
            self._offset -= len(self._docs.popleft()[1])
        return {k: v.astype(np.int32) for k, v in row.items()}

    def get_state(self) -> dict:
        parent = self._docs[0][0] if self._docs else self._parent.get_state()
        return {"parent": parent, "offset": self._offset}

    def set_state(self, state: dict) -> None:
        self._parent.set_state(state["parent"])
        self._docs.clear()
        self._offset = int(state["offset"])
        self._buffered = -self._offset  # the first document read is the one it starts in
