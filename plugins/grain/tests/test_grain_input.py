"""The grain input: the token-file input's packing, resume from the iterator's state,
process sharding, errors naming the file, and a resumed `axplug train` run."""

import json
import shutil

import numpy as np
import pytest
from axplug_grain import GrainInput, write_array_record, write_parquet

from axplug.api.config import ConfigError, ConfigFileError
from axplug.api.data import IGNORE_LABEL, TOKEN_DIR_FORMAT, Input, TokenFileInput, write_shard

EOS = 1
VOCAB = 64
KEYS = ("input_ids", "target_labels", "segment_ids", "positions")


def documents(n=30, seed=0, vocab=VOCAB):
    """Random documents of 2..15 ids, each ending with EOS."""
    rng = np.random.default_rng(seed)
    return [[*map(int, rng.integers(2, vocab, size=rng.integers(1, 15))), EOS] for _ in range(n)]


def marked(n=24, seed=0):
    """Document i holds only the id i + 2 (then EOS): a row's ids tell its documents."""
    rng = np.random.default_rng(seed)
    return [[i + 2] * int(rng.integers(1, 12)) + [EOS] for i in range(n)]


def token_dir(path, docs, vocab=VOCAB):
    """A core token-file data directory of `docs` in shards of 7 documents."""
    path.mkdir(parents=True, exist_ok=True)
    shards = [write_shard(path, f"shard_{i:05d}", docs[s : s + 7], "uint16")
              for i, s in enumerate(range(0, len(docs), 7))]  # fmt: skip
    meta = {"format": TOKEN_DIR_FORMAT, "dtype": "uint16", "vocab_size": vocab, "shards": shards}
    (path / "meta.json").write_text(json.dumps(meta))
    return path


def grain_input(paths, **kwargs):
    kwargs = {"seq_len": 8, "batch_size": 4, "vocab_size": VOCAB, **kwargs}
    paths = [str(p) for p in (paths if isinstance(paths, list) else [paths])]
    return GrainInput.default_config().set(paths=paths, **kwargs).instantiate()


def take(inp, start, count):
    """Batches start..start+count-1 of `inp.iter_from(start)`."""
    it = inp.iter_from(start)
    out = []
    for expected in range(start, start + count):
        step, batch = next(it)
        assert step == expected
        out.append(batch)
    return out


def rows(batches, key):
    return np.concatenate([b[key] for b in batches])


def assert_same(a, b, keys=KEYS):
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        assert set(x) == set(y)
        for key in keys:
            np.testing.assert_array_equal(x[key], y[key], err_msg=key)


def stream_documents(batches):
    """The marked documents' ids in stream order (a document split across rows once)."""
    ids = rows(batches, "input_ids").reshape(-1)  # row k holds stream tokens [kL, kL + L)
    docs = ids[(ids != EOS)]
    return [int(d) - 2 for d, prev in zip(docs, np.r_[-1, docs[:-1]], strict=True) if d != prev]


@pytest.mark.parametrize("split", ["train", "eval"])
def test_rows_are_the_token_file_inputs_stream_windows(tmp_path, split):
    docs = documents(40)
    data = token_dir(tmp_path / "data", docs)
    records = write_array_record(tmp_path / "docs.array_record", docs)
    kw = {"split": split, "eval_fraction": 0.3, "seq_len": 8, "batch_size": 4}
    token = TokenFileInput.default_config().set(path=str(data), packing=True, **kw).instantiate()
    token._permutation = lambda epoch: np.arange(token.num_windows)  # its stream order
    grain = grain_input(records, shuffle=False, **kw)
    windows = token.num_windows
    assert windows >= 12  # several batches of the first epoch
    steps = -(-windows // 4)
    got = take(grain, 0, steps)
    want = [token.batch(s) for s in range(steps)]
    for key in KEYS:
        np.testing.assert_array_equal(rows(got, key)[:windows], rows(want, key)[:windows], key)
    assert all(b[k].dtype == np.int32 and b[k].shape == (4, 8) for b in got for k in KEYS)
    # Packing: targets across a document boundary are ignored, segments restart per row.
    labels, segments = rows(got, "target_labels"), rows(got, "segment_ids")
    assert (labels == IGNORE_LABEL).any() and (segments[:, 0] == 1).all()
    crossing = np.diff(segments) != 0  # the last target's document is in no row's segments
    assert ((labels[:, :-1] == IGNORE_LABEL) == crossing).all()


def test_without_packing_rows_run_across_documents(tmp_path):
    docs = documents(20)
    records = write_array_record(tmp_path / "docs.array_record", docs)
    batch = take(grain_input(records, shuffle=False, packing=False), 0, 1)[0]
    assert set(batch) == {"input_ids", "target_labels"}
    stream = np.concatenate(docs)
    np.testing.assert_array_equal(batch["input_ids"][1], stream[8:16])
    np.testing.assert_array_equal(batch["target_labels"][1], stream[9:17])


def test_parquet_gives_the_array_record_rows_and_globs_concatenate_files(tmp_path):
    docs = documents(40)
    one = write_array_record(tmp_path / "all.array_record", docs)
    parquet = write_parquet(tmp_path / "all.parquet", docs)
    for i, s in enumerate(range(0, 40, 15)):
        write_array_record(tmp_path / f"part-{i}.array_record", docs[s : s + 15])
    want = take(grain_input(one, seed=5), 0, 8)
    assert_same(take(grain_input(parquet, seed=5), 0, 8), want)
    assert_same(take(grain_input(str(tmp_path / "part-*.array_record"), seed=5), 0, 8), want)
    # Another seed, another order.
    other = take(grain_input(one, seed=6), 0, 8)
    assert not np.array_equal(rows(other, "input_ids"), rows(want, "input_ids"))


def test_the_shuffle_is_a_new_permutation_of_the_documents_every_epoch(tmp_path):
    docs = marked(24)
    records = write_array_record(tmp_path / "docs.array_record", docs)
    inp = grain_input(records, eval_fraction=0.1)  # 22 train documents
    tokens = sum(len(d) for d in docs[:22])
    order = stream_documents(take(inp, 0, 3 * tokens // 32 + 2))
    first, second = order[:22], order[22:44]
    assert sorted(first) == sorted(second) == list(range(22))
    assert first != list(range(22)) and second != first
    unshuffled = grain_input(records, eval_fraction=0.1, shuffle=False)
    assert stream_documents(take(unshuffled, 0, tokens // 32))[:20] == list(range(20))


@pytest.mark.parametrize("json_round_trip", [False, True])
def test_a_resumed_stream_equals_an_uninterrupted_one(tmp_path, caplog, json_round_trip):
    records = write_array_record(tmp_path / "docs.array_record", documents(30))
    # 10 batches of 32 tokens: more than an epoch of ~220, so a resume crosses epochs.
    whole = take(grain_input(records, seed=3), 0, 10)
    first = grain_input(records, seed=3)
    it = first.iter_from(0)
    head = [next(it)[1] for _ in range(5)]
    state = first.state_at(5)
    assert state is not None and state["step"] == 5
    next(it)  # a batch fetched ahead (a trainer's prefetch) does not move state_at(5)
    assert first.state_at(5) == state
    if json_round_trip:
        state = json.loads(json.dumps(state))
    resumed = grain_input(records, seed=3)
    resumed.restore_state(5, state)
    assert_same(head + take(resumed, 5, 5), whole)
    assert "replaying" not in caplog.text  # continued from the state
    # Without a state the stream is replayed from step 0: the same batches, slower.
    assert_same(take(grain_input(records, seed=3), 5, 5), whole[5:])
    assert "replaying the 5 batches before it" in caplog.text
    # The state of step 0 and of a step long gone.
    assert first.state_at(0)["iterator"] == {"parent": {"next_index": 0}, "offset": 0}
    assert first.state_at(1000) is None


def test_a_state_of_another_stream_is_not_applied(tmp_path, caplog):
    records = write_array_record(tmp_path / "docs.array_record", documents(30))
    inp = grain_input(records, seed=3)
    take(inp, 0, 4)
    state = inp.state_at(4)
    other = grain_input(records, seed=4)
    other.restore_state(4, state)  # seed changed: a warning, then a replay
    assert "seed" in caplog.text
    assert_same(take(other, 4, 2), take(grain_input(records, seed=4), 0, 6)[4:])
    with pytest.raises(ConfigFileError, match="of step 4, restoring step 3"):
        grain_input(records, seed=3).restore_state(3, state)


def test_each_process_reads_its_own_documents_and_half_the_rows(tmp_path):
    docs = marked(40)
    records = write_array_record(tmp_path / "docs.array_record", docs)
    seen = []
    for index in range(2):
        inp = grain_input(records, batch_size=8, process_index=index, process_count=2)
        assert inp.local_batch_size == 4 and inp.documents == 19  # 38 train documents
        batches = take(inp, 0, 6)  # 192 tokens: less than one epoch of ~230
        assert all(b[k].shape == (4, 8) for b in batches for k in KEYS)
        seen.append(set(stream_documents(batches)))
    assert seen[0] and seen[1] and not seen[0] & seen[1]
    assert seen[0] <= set(range(0, 38, 2)) and seen[1] <= set(range(1, 38, 2))
    with pytest.raises(ConfigError, match="batch_size: 6 is not divisible by process_count=4"):
        grain_input(records, batch_size=6, process_count=4)


def test_bad_data_is_one_error_naming_the_file_and_field(tmp_path):
    with pytest.raises(ConfigFileError, match=r"^paths: .*missing\.array_record: no such file"):
        grain_input(tmp_path / "missing.array_record")
    with pytest.raises(ConfigFileError, match=r"nothing-\*\.parquet: no file matches"):
        grain_input(tmp_path / "nothing-*.parquet")
    text = write_array_record(tmp_path / "text.array_record", documents(5), field="ids")
    with pytest.raises(ConfigFileError, match=r"text\.array_record: record \d+ has no field "
                       r"'tokens' \(it has \['ids'\]\); set the input's `field`"):  # fmt: skip
        take(grain_input(text), 0, 1)
    take(grain_input(text, field="ids"), 0, 1)
    big = write_array_record(tmp_path / "big.array_record", [[3, 4, EOS]] * 2 + [[3, 99, EOS]] * 3)
    with pytest.raises(ConfigFileError, match=r"big\.array_record: record 2 field 'tokens': "
                       "token id 99 is outside the vocabulary of 64"):  # fmt: skip
        take(grain_input(big, shuffle=False, eval_fraction=0.2), 0, 2)
    empty = write_array_record(tmp_path / "empty.array_record", [[]] * 5)
    with pytest.raises(ConfigFileError, match="empty documents in a row: no tokens to pack"):
        take(grain_input(empty), 0, 1)
    parquet = write_parquet(tmp_path / "p.parquet", documents(5), field="ids")
    with pytest.raises(ConfigFileError, match=r"p\.parquet: no column 'tokens'"):
        grain_input(parquet)
    with pytest.raises(ConfigError, match="^vocab_size: must be an int >= 1"):
        grain_input(text, vocab_size=0)


@pytest.mark.skipif(not hasattr(Input, "state_at"), reason="the trainer saves no input state")
def test_axplug_train_resumed_from_a_checkpoint_equals_an_uninterrupted_run(
    tmp_path, capsys, caplog
):
    from axplug_testing import cli_main as main
    from axplug_testing import tiny_train_args

    from axplug.api.checkpoint import Checkpointer, delete_step
    from axplug.api.summary import read_jsonl

    records = write_array_record(tmp_path / "docs.array_record", documents(200))
    spec = f"grain:paths=[{str(records)!r}],vocab_size={VOCAB}"
    overrides = ("log_every=1", "input.seq_len=16", "model.decoder.transformer.num_layers=1")

    def train(run):
        args = tiny_train_args(tmp_path / run, *overrides, preset="llama-tiny", max_steps=6)
        args += ["--mesh-rule", "none", "--input", spec, "--checkpoint-every", "2", "-q"]
        assert main(args) == 0, capsys.readouterr().err
        return {r["step"]: r["loss"] for r in read_jsonl(tmp_path / run / "metrics.jsonl")
                if "loss" in r}  # fmt: skip

    whole = train("whole")
    assert sorted(whole) == [1, 2, 3, 4, 5, 6]
    # The run as if stopped after saving step 4: its directory without step 6 and metrics.
    shutil.copytree(tmp_path / "whole", tmp_path / "resumed")
    (tmp_path / "resumed" / "metrics.jsonl").unlink()
    directory = str(tmp_path / "resumed" / "checkpoints")
    with Checkpointer.default_config().set(directory=directory).instantiate() as checkpointer:
        saved = checkpointer.metadata(4)["input_state"]  # one state per process
        assert delete_step(checkpointer.storage, directory, 6)
    assert len(saved) == 1 and saved[0]["format"] == "axplug-grain-1" and saved[0]["step"] == 4
    resumed = train("resumed")
    assert sorted(resumed) == [5, 6]  # resumed at step 4, from the saved input state:
    assert "replaying" not in caplog.text
    for step in (5, 6):
        assert resumed[step] == whole[step]


@pytest.mark.slow  # Grain's worker processes; in-process resumes are tested above
def test_worker_processes_resume_from_their_state(tmp_path):
    records = write_array_record(tmp_path / "docs.array_record", documents(30))
    whole = take(grain_input(records, worker_count=2), 0, 8)
    # Each worker packs its own slice of the documents: other rows than in-process reading.
    assert not np.array_equal(rows(whole, "input_ids"), rows(take(grain_input(records), 0, 8),
                                                             "input_ids"))  # fmt: skip
    first = grain_input(records, worker_count=2)
    it = first.iter_from(0)
    head = [next(it)[1] for _ in range(4)]
    state = json.loads(json.dumps(first.state_at(4)))
    it.close()
    resumed = grain_input(records, worker_count=2)
    resumed.restore_state(4, state)
    assert_same(head + take(resumed, 4, 4), whole)
