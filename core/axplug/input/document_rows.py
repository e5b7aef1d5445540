"""Rows that start at documents (`TokenFileInput(rows="documents")`): fine-tuning data, where
a conversation cut across two rows would lose its context.

Each row holds whole documents in order (several with packing, else one), a document longer
than the row cut to it; the rest of a row is padding whose targets the loss ignores.
"""

from __future__ import annotations

import numpy as np

__all__ = ["plan_rows", "row_batch"]


def plan_rows(doc_starts: np.ndarray, first: int, last: int, length: int, packing: bool):
    """[rows, 2] (first document, end document) of documents `first..last-1` in rows of
    `length` tokens: greedily packed in order, or one per row."""
    sizes = np.minimum(np.diff(doc_starts[first : last + 1]), length)
    if not packing:
        docs = np.arange(first, last)
        return np.stack([docs, docs + 1], axis=1)
    rows, start, used = [], first, 0
    for i, size in enumerate(sizes, first):
        if used + size > length and i > start:
            rows.append((start, i))
            start, used = i, 0
        used += int(size)
    rows.append((start, last))
    return np.asarray(rows, np.int64)


def row_batch(read, doc_starts: np.ndarray, rows: np.ndarray, length: int, ignore: int,
              packing: bool, values=None) -> dict:  # fmt: skip
    """The batch of `rows` (from `plan_rows`) of `length` = seq_len + 1 tokens.

    `read(start, count)` returns (tokens, mask or None) of the token stream. A target counts
    where the next token is in the same document, is not padding, and its mask is 1.
    `values` maps names to (`read(start, count)` of per-token float values, their width, and
    whether they align with the inputs), served aligned with the targets (0 where a target
    does not count), or with the inputs (whole)."""
    values = values or {}
    held = {
        name: np.zeros((len(rows), length, *([width] if width > 1 else [])), np.float32)
        for name, (_, width, _) in values.items()
    }
    n = len(rows)
    tokens = np.zeros((n, length), np.int64)
    mask = np.zeros((n, length), bool)
    doc = np.zeros((n, length), np.int64)  # 1-based document within the row; 0: padding
    positions = np.zeros((n, length), np.int64)
    for r, (first, end) in enumerate(rows):
        at = 0
        for k, d in enumerate(range(first, end), 1):
            start = int(doc_starts[d])
            size = min(int(doc_starts[d + 1]) - start, length - at)
            ids, kept = read(start, size)
            tokens[r, at : at + size] = ids
            mask[r, at : at + size] = True if kept is None else kept.astype(bool)
            doc[r, at : at + size] = k
            positions[r, at : at + size] = np.arange(size)
            for name, (read_values, _, _) in values.items():
                held[name][r, at : at + size] = read_values(start, size)
            at += size
    same = (doc[:, 1:] == doc[:, :-1]) & (doc[:, 1:] > 0)
    batch = {
        "input_ids": tokens[:, :-1],
        "target_labels": np.where(same & mask[:, 1:], tokens[:, 1:], ignore),
    }
    if packing:
        batch["segment_ids"] = doc[:, :-1]
        batch["positions"] = positions[:, :-1]
    counted = batch["target_labels"] != ignore
    for name, array in held.items():
        if values[name][2]:  # aligned with the inputs
            batch[name] = array[:, :-1]
            continue
        batch[name] = np.where(counted, array[:, 1:], 0.0).astype(np.float32)
    return batch
