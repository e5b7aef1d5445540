"""Token files with loss masks, rows that start at documents, and groups of rows."""

import json

import numpy as np
import pytest

from axplug.config import ConfigError
from axplug.input.token_file import IGNORE_LABEL, TOKEN_DIR_FORMAT, TokenFileInput, write_shard


def make_masked(path, documents, masks, vocab=50):
    path.mkdir(parents=True, exist_ok=True)
    shards = [write_shard(path, "shard_00000", documents, "uint16", masks)]
    meta = {"format": TOKEN_DIR_FORMAT, "dtype": "uint16", "vocab_size": vocab, "shards": shards,
            "loss_mask": True}  # fmt: skip
    (path / "meta.json").write_text(json.dumps(meta))
    return path


def docs_and_masks(n=10, seed=0):
    rng = np.random.default_rng(seed)
    docs = [list(rng.integers(1, 50, size=int(rng.integers(3, 9)))) for _ in range(n)]
    masks = [list(rng.integers(0, 2, size=len(d))) for d in docs]
    return docs, masks


def make_input(path, **kwargs):
    cfg = TokenFileInput.default_config().set(path=str(path), seq_len=10, batch_size=2,
                                              eval_fraction=0.2, **kwargs)  # fmt: skip
    return cfg.instantiate()


def test_document_rows_hold_one_document_each_with_its_masked_targets(tmp_path):
    docs, masks = docs_and_masks()
    inp = make_input(make_masked(tmp_path, docs, masks), rows="documents")
    assert inp.num_windows == 8  # the training documents, one row each
    seen = set()
    for step in range(4):
        batch = inp.batch(step)
        for ids, labels in zip(batch["input_ids"], batch["target_labels"], strict=True):
            d = next(i for i, doc in enumerate(docs) if list(ids[: len(doc) - 1]) == doc[:-1])
            seen.add(d)
            doc, mask = docs[d], masks[d]
            want = [doc[t + 1] if mask[t + 1] else IGNORE_LABEL for t in range(len(doc) - 1)]
            assert list(labels[: len(doc) - 1]) == want
            assert (labels[len(doc) - 1 :] == IGNORE_LABEL).all()  # padding
    assert seen == set(range(8))  # an epoch: every training document once


def test_packed_document_rows_keep_documents_apart(tmp_path):
    docs, masks = docs_and_masks()
    inp = make_input(make_masked(tmp_path, docs, masks), rows="documents", packing=True)
    assert inp.num_windows < 8
    batch = inp.batch(0)
    for seg, pos in zip(batch["segment_ids"], batch["positions"], strict=True):
        for s in set(seg[seg > 0]):
            assert list(pos[seg == s]) == list(range((seg == s).sum()))  # restarts per document


def test_groups_of_rows_stay_together(tmp_path):
    docs, masks = docs_and_masks(n=12)
    inp = make_input(make_masked(tmp_path, docs, masks), rows="documents", group=2)
    for step in range(3):
        ids = inp.batch(step)["input_ids"]
        first = next(i for i, d in enumerate(docs) if list(ids[0][: len(d) - 1]) == d[:-1])
        assert first % 2 == 0 and list(ids[1][: len(docs[first + 1]) - 1]) == docs[first + 1][:-1]


def test_the_stream_ignores_masked_targets(tmp_path):
    docs, masks = docs_and_masks()
    inp = make_input(make_masked(tmp_path, docs, masks))
    stream, kept = np.concatenate(docs), np.concatenate(masks)
    batch = inp.batch(0)
    for r in range(2):
        start = inp.window_start(r)
        want = np.where(kept[start + 1 : start + 11] > 0, stream[start + 1 : start + 11], -1)
        np.testing.assert_array_equal(batch["target_labels"][r], want)


@pytest.mark.parametrize(
    "kwargs, message",
    [({"rows": "sentences"}, r"rows: 'sentences'"),
     ({"rows": "documents", "group": 3}, r"group: 3: must be >= 1, divide batch_size"),
     ({"group": 2}, r"group: 2: .*rows='documents'")],
)  # fmt: skip
def test_bad_row_options_name_the_field(tmp_path, kwargs, message):
    docs, masks = docs_and_masks()
    with pytest.raises(ConfigError, match=message):
        make_input(make_masked(tmp_path, docs, masks), **kwargs)


def test_a_missing_mask_file_is_named(tmp_path):
    docs, masks = docs_and_masks()
    data = make_masked(tmp_path, docs, masks)
    (data / "shard_00000.mask.bin").unlink()
    with pytest.raises(ConfigError, match=r"shard_00000\.mask\.bin: missing"):
        make_input(data)
