"""Input pipelines: step-addressed determinism, corpus windows, splits, sharding, user iterators."""

import textwrap

import numpy as np
import pytest

from axplug.config import Configurable, InstantiableConfig, config_class
from axplug.input import (
    ByteTextInput,
    IteratorInput,
    SyntheticInput,
    bundled_corpus_path,
    resolve_function,
)


def text_input(**kw):
    return ByteTextInput.default_config().set(**kw).instantiate()


@pytest.fixture
def random_file(tmp_path):
    """20,000 random bytes: every 33-byte window occurs once, so a window pins its offset."""
    path = tmp_path / "random.bin"
    path.write_bytes(np.random.default_rng(0).integers(0, 256, 20_000, dtype=np.uint8).tobytes())
    return path


def offsets_in(raw: bytes, batch: dict) -> list[int]:
    """Where each row's (inputs + last target) window occurs in `raw`; -1 if nowhere."""
    windows = np.concatenate([batch["input_ids"], batch["target_labels"][:, -1:]], axis=1)
    return [raw.find(bytes(w.astype(np.uint8).tolist())) for w in windows]


def test_bundled_corpus_is_public_domain_text_of_the_promised_size():
    path = bundled_corpus_path()
    raw = path.read_bytes()
    assert 200_000 <= len(raw) <= 600_000
    text = raw.decode("ascii")
    assert "Shakespeare" in text and "gutenberg" not in text.lower()
    assert (path.parent / "SOURCE.md").is_file()


def test_batch_is_a_pure_function_of_seed_and_step():
    a, b = text_input(seq_len=32, batch_size=4), text_input(seq_len=32, batch_size=4)
    for step in (0, 7, 10**9):
        for key in ("input_ids", "target_labels"):
            np.testing.assert_array_equal(a.batch(step)[key], b.batch(step)[key])
    assert not np.array_equal(a.batch(7)["input_ids"], a.batch(8)["input_ids"])
    other_seed = text_input(seq_len=32, batch_size=4, seed=1)
    assert not np.array_equal(a.batch(7)["input_ids"], other_seed.batch(7)["input_ids"])


def test_iter_from_resumes_with_the_same_batches():
    inp = text_input(seq_len=16, batch_size=2)
    it = inp.iter_from(5)
    for expected_step in (5, 6, 7):
        step, batch = next(it)
        assert step == expected_step
        np.testing.assert_array_equal(batch["input_ids"], inp.batch(step)["input_ids"])


def test_batch_shapes_dtypes_and_shifted_targets():
    batch = text_input(seq_len=64, batch_size=3).batch(0)
    assert set(batch) == {"input_ids", "target_labels"}
    for v in batch.values():
        assert v.shape == (3, 64) and v.dtype == np.int32
        assert v.min() >= 0 and v.max() <= 255
    np.testing.assert_array_equal(batch["input_ids"][:, 1:], batch["target_labels"][:, :-1])


def test_rows_are_windows_of_the_raw_corpus():
    raw = bundled_corpus_path().read_bytes()
    inp = text_input(seq_len=128, batch_size=8)
    for step in range(3):
        assert all(off >= 0 for off in offsets_in(raw, inp.batch(step)))


def test_eval_split_is_the_held_out_tail_and_train_never_touches_it(random_file):
    raw = random_file.read_bytes()
    eval_start = len(raw) - int(len(raw) * 0.1)
    seq_len = 32
    train = text_input(path=str(random_file), seq_len=seq_len, batch_size=16, eval_fraction=0.1)
    held = train.config.clone(split="eval").instantiate()
    assert len(held.data) == len(raw) - eval_start
    for step in range(20):
        for off in offsets_in(raw, train.batch(step)):
            assert off >= 0 and off + seq_len + 1 <= eval_start
        for off in offsets_in(raw, held.batch(step)):
            assert eval_start <= off <= len(raw) - seq_len - 1


@pytest.mark.parametrize("cls", ["text", "synthetic"])
def test_process_rows_concatenate_to_the_global_batch(cls):
    def make(**kw):
        if cls == "text":
            return text_input(seq_len=16, batch_size=8, seed=3, **kw)
        cfg = SyntheticInput.default_config().set(vocab_size=50, seq_len=16, batch_size=8, seed=3)
        return cfg.set(**kw).instantiate()

    whole = make().batch(11)
    for count in (2, 4):
        parts = [make(process_index=i, process_count=count).batch(11) for i in range(count)]
        assert parts[0]["input_ids"].shape == (8 // count, 16)
        for key in whole:
            np.testing.assert_array_equal(np.concatenate([p[key] for p in parts]), whole[key])


def test_synthetic_shapes_range_and_determinism():
    cfg = SyntheticInput.default_config().set(vocab_size=1000, seq_len=24, batch_size=5)
    a, b = cfg.instantiate(), cfg.instantiate()
    batch = a.batch(2)
    assert batch["input_ids"].shape == batch["target_labels"].shape == (5, 24)
    assert batch["input_ids"].dtype == np.int32
    assert batch["input_ids"].min() >= 0 and batch["input_ids"].max() < 1000
    np.testing.assert_array_equal(batch["input_ids"][:, 1:], batch["target_labels"][:, :-1])
    np.testing.assert_array_equal(b.batch(2)["target_labels"], batch["target_labels"])
    assert not np.array_equal(a.batch(3)["input_ids"], batch["input_ids"])
    assert a.vocab_size == 1000


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    (tmp_path / "axplug_test_user_data.py").write_text(
        textwrap.dedent(
            """
            import numpy as np

            def batches(start_step, *, scale=1):
                step = start_step
                while True:
                    yield {"input_ids": np.full((2, 3), step * scale, np.int32)}
                    step += 1

            def two_lists(start_step):
                return iter([[1], [2]])

            NOT_CALLABLE = 3
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    return "axplug_test_user_data"


def test_iterator_input_runs_a_user_function_from_the_start_step(user_module):
    cfg = IteratorInput.default_config().set(
        make_iterator=f"{user_module}:batches", kwargs={"scale": 10}
    )
    it = cfg.instantiate().iter_from(4)
    for expected in (4, 5, 6):
        step, batch = next(it)
        assert step == expected
        np.testing.assert_array_equal(batch["input_ids"], np.full((2, 3), 10 * step))


def test_iterator_input_errors_name_the_field_and_the_problem(user_module):
    def make(spec):
        return IteratorInput.default_config().set(make_iterator=spec).instantiate()

    with pytest.raises(ValueError, match=r"^make_iterator: expected 'module:function'"):
        make("no_colon")
    with pytest.raises(ValueError, match=r"make_iterator: cannot import module 'no_such_mod_xyz'"):
        make("no_such_mod_xyz:f")
    with pytest.raises(ValueError, match=r"has no attribute 'missing'"):
        make(f"{user_module}:missing")
    with pytest.raises(ValueError, match=r"not a callable"):
        make(f"{user_module}:NOT_CALLABLE")
    with pytest.raises(TypeError, match=r"two_lists yielded a list at step 0; it must yield dicts"):
        next(make(f"{user_module}:two_lists").iter_from(0))
    assert resolve_function("os.path:join") is __import__("os").path.join


def test_errors_name_the_config_field(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"^path: file '.*nope.txt' does not exist"):
        text_input(path=str(tmp_path / "nope.txt"))
    short = tmp_path / "short.txt"
    short.write_text("x" * 100)
    with pytest.raises(ValueError, match=r"^seq_len: the train split .* fewer than seq_len \+ 1"):
        text_input(path=str(short), seq_len=256)
    with pytest.raises(ValueError, match=r"^batch_size: must be >= 1, got 0"):
        text_input(batch_size=0)
    with pytest.raises(ValueError, match=r"^batch_size: 6 is not divisible by process_count=4"):
        text_input(batch_size=6, process_count=4)
    with pytest.raises(ValueError, match=r"^process_index: must be in \[0, process_count=2\)"):
        text_input(process_index=2, process_count=2)
    with pytest.raises(ValueError, match=r"^split: must be 'train' or 'eval', got 'test'"):
        text_input(split="test")
    with pytest.raises(ValueError, match=r"step must be an int >= 0"):
        text_input().batch(-1)


class Trainer(Configurable):
    @config_class
    class Config(Configurable.Config):
        input: InstantiableConfig = ByteTextInput.default_config()


def test_errors_carry_the_dotted_path_in_a_config_tree():
    cfg = Trainer.default_config()
    cfg.input.batch_size = 0
    with pytest.raises(ValueError, match=r"^input\.batch_size: must be >= 1"):
        cfg.input.instantiate()
