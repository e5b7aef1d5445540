"""The mixture input: exact shares per block, each source's own rows, pure in (seed, step)."""

import json

import numpy as np
import pytest
from axplug_mixture import BLOCK, MixtureInput, quotas
from axplug_testing import cli_main as main

from axplug.api.config import ConfigError
from axplug.api.data import TokenFileInput
from test_token_file import make_data


def _tagged(path, low, high, n=40, seed=0):
    """A data directory whose tokens all lie in [low, high): a row tells its source."""
    rng = np.random.default_rng(seed)
    docs = [list(rng.integers(low, high, size=rng.integers(20, 60))) for _ in range(n)]
    return make_data(path, docs, shard_docs=7, vocab=256)


@pytest.fixture
def sources(tmp_path):
    return str(_tagged(tmp_path / "web", 1, 100)), str(_tagged(tmp_path / "code", 150, 256, 25))


def _mixture(sources, **kwargs):
    kwargs = {"names": ["web", "code"], **kwargs}
    cfg = MixtureInput.default_config().set(sources=list(sources), seq_len=16, batch_size=8,
                                            **kwargs)  # fmt: skip
    return cfg.instantiate()


def _source_of(row):
    assert (row < 100).all() or (row >= 150).all(), row  # one source per row
    return 0 if row[0] < 100 else 1


def test_quotas_are_exact_shares_by_largest_remainder():
    assert quotas([0.7, 0.3], 1000).tolist() == [700, 300]
    assert quotas([1, 1, 1], 1000).tolist() == [334, 333, 333]
    assert quotas([0.5, 0.25, 0.25, 0.0], 10).tolist() == [5, 3, 2, 0]


def test_a_70_30_mixture_serves_70_30_of_tokens_over_1000_steps(sources):
    mix = _mixture(sources, weights=[0.7, 0.3])
    metrics = mix.metrics(1000)
    web, code = metrics["data/tokens/web"], metrics["data/tokens/code"]
    assert web + code == 1000 * 8 * 16
    assert abs(web / (web + code) - 0.7) < 0.01
    # The metrics count what the batches hold: every row of 300 steps, by its tokens.
    counts = np.zeros(2, np.int64)
    for step in range(300):
        for row in mix.batch(step)["input_ids"]:
            counts[_source_of(row)] += 1
    np.testing.assert_array_equal(counts, mix.rows_before(300))
    assert abs(counts[0] / counts.sum() - 0.7) < 0.01


def test_each_source_serves_its_own_samples_in_order(sources):
    """Row n of the mixture is sample k of its source: its rows, epochs and shuffle."""
    alone = [
        TokenFileInput.default_config()
        .set(path=p, seq_len=16, batch_size=8, seed=3 + i, packing=True)
        .instantiate()  # fmt: skip
        for i, p in enumerate(sources)
    ]
    mix = _mixture(sources, weights=[0.6, 0.4], packing=True, seed=3)
    batch = mix.batch(7)
    for r in range(8):
        source, sample = mix.sample_of(7 * 8 + r)
        row = alone[source].rows([sample])
        for key in batch:
            np.testing.assert_array_equal(batch[key][r], row[key][0])


def test_batches_are_pure_in_seed_and_step_and_processes_split_them(sources):
    whole = _mixture(sources, weights=[0.7, 0.3], seed=5)
    again = _mixture(sources, weights=[0.7, 0.3], seed=5)
    steps = [0, 124, 125, 126, 2000]  # 125 * 8 = one block: the schedule's edge
    for step in steps:
        a, b = whole.batch(step), again.batch(step)
        np.testing.assert_array_equal(a["input_ids"], b["input_ids"])
        halves = [_mixture(sources, weights=[0.7, 0.3], seed=5, process_index=i,
                           process_count=2).batch(step) for i in range(2)]  # fmt: skip
        np.testing.assert_array_equal(
            np.concatenate([h["target_labels"] for h in halves]), a["target_labels"]
        )
    other = _mixture(sources, weights=[0.7, 0.3], seed=6)
    assert not np.array_equal(other.batch(0)["input_ids"], whole.batch(0)["input_ids"])
    # resumed mid-stream: iter_from(step) is the same batches as from the start
    from_start = [b for _, (_, b) in zip(range(6), whole.iter_from(0), strict=False)]
    resumed = [b for _, (_, b) in zip(range(3), again.iter_from(3), strict=False)]
    for a, b in zip(from_start[3:], resumed, strict=True):
        np.testing.assert_array_equal(a["input_ids"], b["input_ids"])


def test_epochs_weigh_sources_by_their_size(sources):
    mix = _mixture(sources, epochs=[1, 2])
    web, code = (s.num_windows for s in mix.sources)
    np.testing.assert_allclose(mix.weights, np.array([web, 2 * code]) / (web + 2 * code))
    assert sum(mix.quota) == BLOCK


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"weights": [0.7]}, "weights: [0.7]: one number >= 0 per source (2)"),
        ({"weights": [0.7, 0.3], "epochs": [1, 1]}, "give either weights or epochs"),
        ({"weights": [0, 0]}, "not all 0"),
        ({"weights": [1, 1], "names": ["a", "a"]}, "2 distinct names"),
    ],
)
def test_bad_mixtures_are_one_error_naming_the_field(sources, kwargs, message):
    with pytest.raises(ConfigError) as info:
        _mixture(sources, **kwargs)
    assert message in str(info.value)


def test_sources_of_different_tokenizers_are_refused(tmp_path, sources):
    other = make_data(tmp_path / "other", [[1, 2, 3, 4]] * 8, vocab=512)
    with pytest.raises(ConfigError, match="tokenizers of different vocabularies"):
        _mixture([sources[0], str(other)], weights=[1, 1])


def _prepared(tmp_path, name, tokenizer):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("the quick brown fox jumps over the lazy dog\n\n" * 40, encoding="utf-8")
    out = tmp_path / name
    argv = ["prepare-data", str(corpus), "--tokenizer", str(tokenizer), "--output", str(out),
            "--text-unit", "paragraph", "--workers", "1"]  # fmt: skip
    assert main(argv) == 0
    return str(out)


def test_sources_of_other_tokenizers_of_one_size_are_refused(tmp_path, capsys):
    from tokenizer_files import hf_bpe

    one = hf_bpe(tmp_path / "one")
    spec = json.loads(one.read_text())  # another tokenizer of the same size: two ids swapped
    vocab = spec["model"]["vocab"]
    a, b = (k for k, v in vocab.items() if v in (100, 101))
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "tokenizer.json").write_text(json.dumps(spec))
    first = _prepared(tmp_path, "first", one)
    second = _prepared(tmp_path, "second", tmp_path / "other" / "tokenizer.json")
    capsys.readouterr()
    with pytest.raises(ConfigError, match="sources of different tokenizers of one size") as info:
        _mixture([first, second], weights=[1, 1])
    assert f"{first} (sha256 " in str(info.value) and "mixed_tokenizers=True" in str(info.value)
    assert _mixture([first, second], weights=[1, 1], mixed_tokenizers=True).vocab_size == 400
    again = _prepared(tmp_path, "again", one)  # the same tokenizer: one mixture
    assert _mixture([first, again], weights=[1, 1]).vocab_size == 400


def test_sources_without_a_tokenizer_hash_are_compared_by_size_with_a_warning(sources, caplog):
    with caplog.at_level("WARNING", logger="axplug.input"):
        _mixture(sources, weights=[1, 1])
    assert "record no tokenizer hash" in caplog.text


def test_train_logs_per_source_tokens_and_resumes_exactly(tmp_path, sources):
    """Through the CLI: metrics per source; a 2-step run resumed to 4 equals a 4-step run."""
    spec = f"mixture:sources={list(sources)!r},weights=[0.7,0.3],names=['web','code']"
    base = ["train", "--preset", "gpt-tiny", "--modifier", "mesh", "--input", spec,
            "--set", "input.seq_len=16",
            "--set", "input.batch_size=8", "--set", "model.decoder.dim=32",
            "--set", "model.decoder.transformer.layer.feed_forward.hidden_dim=64",
            "--set", "compilation_cache_dir=None", "--set", "log_every=1",
            "--checkpoint-every", "2"]  # fmt: skip
    assert main([*base, "--output-dir", str(tmp_path / "whole"), "--max-steps", "4",
                 "--set", "eval_every=2"]) == 0  # fmt: skip
    assert main([*base, "--output-dir", str(tmp_path / "cut"), "--max-steps", "2"]) == 0
    assert main([*base, "--output-dir", str(tmp_path / "cut"), "--max-steps", "4"]) == 0

    def rows(name):
        lines = (tmp_path / name / "metrics.jsonl").read_text().splitlines()
        return {r["step"]: r for r in map(json.loads, lines) if "loss" in r}

    whole, cut = rows("whole"), rows("cut")
    assert [whole[s]["loss"] for s in (3, 4)] == [cut[s]["loss"] for s in (3, 4)]
    assert whole[4]["data/tokens/web"] + whole[4]["data/tokens/code"] == 4 * 8 * 16
    evals = (tmp_path / "whole" / "metrics.jsonl").read_text()
    assert '"eval_loss"' in evals  # the sources' held-out documents
