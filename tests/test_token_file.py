"""The token-file input: epochs without replacement, process rows, packing, splits."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from axplug_testing import tiny_train_args

from axplug.input.token_file import IGNORE_LABEL, TOKEN_DIR_FORMAT, TokenFileInput, write_shard


def make_data(path, documents, *, shard_docs=3, vocab=50):
    """A data directory of `documents` (lists of ids) in shards of `shard_docs` documents."""
    path.mkdir(parents=True, exist_ok=True)
    shards = [
        write_shard(path, f"shard_{i:05d}", documents[s : s + shard_docs], "uint16")
        for i, s in enumerate(range(0, len(documents), shard_docs))
    ]
    meta = {"format": TOKEN_DIR_FORMAT, "dtype": "uint16", "vocab_size": vocab, "shards": shards}
    (path / "meta.json").write_text(json.dumps(meta))
    return path


def documents(n=12, seed=0, vocab=50):
    rng = np.random.default_rng(seed)
    return [list(rng.integers(1, vocab, size=rng.integers(3, 15))) for _ in range(n)]


def token_input(path, **kwargs):
    cfg = TokenFileInput.default_config().set(path=str(path), seq_len=8, batch_size=4, **kwargs)
    return cfg.instantiate()


def test_an_epoch_visits_every_window_once_in_a_seeded_order(tmp_path):
    docs = documents()
    data = make_data(tmp_path, docs)
    inp = token_input(data)
    stream = np.concatenate(docs)
    train_tokens = sum(len(d) for d in docs[: len(docs) - max(1, int(len(docs) * 0.05))])
    assert inp.num_windows == (train_tokens - 1) // 8
    n = inp.num_windows
    starts = [inp.window_start(i) for i in range(n)]
    assert sorted(starts) == [8 * i for i in range(n)]  # each window once
    second = [inp.window_start(n + i) for i in range(n)]
    assert sorted(second) == sorted(starts) and second != starts  # a new order each epoch
    batch = inp.batch(1)
    for row, start in enumerate(starts[4:8]):  # step 1 = samples 4..7
        np.testing.assert_array_equal(batch["input_ids"][row], stream[start : start + 8])
        np.testing.assert_array_equal(batch["target_labels"][row], stream[start + 1 : start + 9])
    again = token_input(data)  # a resumed run: the same batches, from any step
    step, resumed = next(again.iter_from(3))
    assert step == 3
    for key, value in inp.batch(3).items():
        np.testing.assert_array_equal(resumed[key], value)
    other = token_input(data, seed=1)
    assert not np.array_equal(other.batch(0)["input_ids"], inp.batch(0)["input_ids"])


def test_process_rows_concatenate_to_the_global_batch(tmp_path):
    data = make_data(tmp_path, documents(20))
    whole = token_input(data, packing=True).batch(2)
    parts = [token_input(data, packing=True, process_index=i, process_count=2).batch(2)
             for i in range(2)]  # fmt: skip
    for key in whole:
        np.testing.assert_array_equal(np.concatenate([p[key] for p in parts]), whole[key])


def test_eval_split_holds_the_last_documents(tmp_path):
    docs = documents(20)
    data = make_data(tmp_path, docs)
    ev = token_input(data, split="eval", eval_fraction=0.25)
    first_eval_token = sum(len(d) for d in docs[:15])
    seen = {ev.window_start(i) for i in range(ev.num_windows)}
    assert min(seen) == first_eval_token
    tr = token_input(data, split="train", eval_fraction=0.25)
    assert max(tr.window_start(i) for i in range(tr.num_windows)) + 9 <= first_eval_token


def test_packing_marks_documents_positions_and_boundary_targets(tmp_path):
    docs = [[1, 2, 3], [4, 5, 6, 7, 8], [9, 10], [11, 12, 13, 14, 15, 16, 17], [18] * 20]
    data = make_data(tmp_path, docs, shard_docs=2)
    inp = token_input(data, packing=True, eval_fraction=0.2)
    starts = [inp.window_start(i) for i in range(4)]
    batch = inp.batch(0)
    doc_of = np.repeat(np.arange(len(docs)), [len(d) for d in docs])
    first_of = np.concatenate([[0], np.cumsum([len(d) for d in docs])])
    for row, s in enumerate(starts):
        idx = np.arange(s, s + 9)
        d = doc_of[idx]
        np.testing.assert_array_equal(batch["segment_ids"][row], d[:-1] - d[0] + 1)
        np.testing.assert_array_equal(batch["positions"][row], idx[:-1] - first_of[d[:-1]])
        want = np.where(d[1:] == d[:-1], np.concatenate(docs)[idx[1:]], IGNORE_LABEL)
        np.testing.assert_array_equal(batch["target_labels"][row], want)


def test_vector_token_values_aligned_with_the_inputs_travel_with_their_tokens(tmp_path):
    """An image's pixels stored per placeholder token (`"width"`, `"aligned": "inputs"`)
    reach every row beside their own tokens, whole; stream windows, which could start inside
    an image, are refused."""
    docs = documents(8)
    data = make_data(tmp_path, docs, shard_docs=3)
    meta = json.loads((data / "meta.json").read_text())
    for shard in meta["shards"]:
        tokens = np.fromfile(data / f"{shard['name']}.bin", np.uint16).astype(np.float32)
        # Each token's values: (the token, its square, -1), so rows can be checked by id.
        values = np.stack([tokens, tokens**2, -np.ones_like(tokens)], 1)
        values.tofile(data / f"{shard['name']}.pix.bin")
    meta["token_values"] = {"pix": {"dtype": "float32", "width": 3, "aligned": "inputs"}}
    (data / "meta.json").write_text(json.dumps(meta))
    batch = token_input(data, rows="documents", packing=True).batch(0)
    ids = batch["input_ids"].astype(np.float32)
    real = batch["segment_ids"] > 0
    want = np.where(real[..., None], np.stack([ids, ids**2, -np.ones_like(ids)], -1), 0)
    np.testing.assert_array_equal(batch["pix"], want)
    from axplug.config import ConfigError

    with pytest.raises(ConfigError, match=r"rows: .stream.: .* \[.pix.\] ride whole documents"):
        token_input(data, rows="stream")


def test_a_packed_rows_loss_is_the_sum_of_its_documents_losses(tmp_path):
    from axplug.context import functional
    from axplug.layers import CausalLM

    docs = documents(10, vocab=40)
    inp = token_input(make_data(tmp_path, docs, vocab=40), packing=True)
    batch = inp.batch(0)
    cfg = CausalLM.default_config()
    cfg.decoder.set(vocab_size=40, dim=16)
    cfg.decoder.transformer.set(num_layers=2)
    cfg.decoder.transformer.layer.attention.set(num_heads=2)
    cfg.decoder.transformer.layer.feed_forward.set(hidden_dim=32)
    model = cfg.instantiate(parent=None)
    params = model.initialize_parameters_recursively(jax.random.PRNGKey(0))

    @jax.jit  # one program per input structure, not one per op and shape
    def forward(inputs):
        (loss, aux), _ = functional(
            model, prng_key=None, state=params, inputs=inputs, is_training=False
        )
        return loss, aux["num_tokens"]

    def total(inputs):  # summed token losses and the token count
        loss, count = forward(inputs)
        return float(loss) * float(count), float(count)

    width = batch["input_ids"].shape[1]
    for row in range(batch["input_ids"].shape[0]):
        packed = total({k: jnp.asarray(v[row : row + 1]) for k, v in batch.items()})
        alone, count = 0.0, 0.0
        seg = batch["segment_ids"][row]
        for s in np.unique(seg):
            cols = seg == s
            labels = batch["target_labels"][row][cols]
            if (labels >= 0).any():
                # A document alone, unpacked (no segments, positions from 0), at the front of
                # a row of the batch's width: the tokens after it are padding it never attends
                # to (causal) whose targets the loss skips. One shape: one program, not one
                # per document length.
                pad = width - labels.size
                ids = np.pad(batch["input_ids"][row][cols], (0, pad))
                labels = np.pad(labels, (0, pad), constant_values=IGNORE_LABEL)
                loss, n = total((jnp.asarray(ids[None]), jnp.asarray(labels[None])))
                alone, count = alone + loss, count + n
        assert packed[1] == count
        np.testing.assert_allclose(packed[0], alone, rtol=2e-5)


def test_bad_settings_name_the_field(tmp_path):
    from axplug.config import ConfigError

    with pytest.raises(ConfigError, match="is not a prepared data directory .*axplug prepare-data"):
        token_input(tmp_path)
    data = make_data(tmp_path / "d", documents(4))
    with pytest.raises(ValueError, match="seq_len: the train split of .* fewer than seq_len"):
        token_input(data).__class__(
            TokenFileInput.default_config().set(path=str(data), seq_len=4000)
        )


# -- `axplug train --input` -------------------------------------------------------------------


def parse(*argv):
    from axplug.cli.main import build_parser

    return build_parser().parse_args(["train", *argv])


def test_input_flag_swaps_the_input_carries_its_shape_and_sizes_the_vocab(tmp_path, capsys):
    from axplug.cli.train_cmd import build_config

    data = make_data(tmp_path / "d", documents(40, vocab=300), vocab=300)
    cfg = build_config(parse("--preset", "llama-tiny", "--mesh-rule", "none",
                             "--input", f"token_file:path={str(data)!r},packing=True"))  # fmt: skip
    assert cfg.input.klass is TokenFileInput and cfg.input.packing is True
    preset = build_config(parse("--preset", "llama-tiny", "--mesh-rule", "none"))
    assert (cfg.input.seq_len, cfg.input.batch_size) == (preset.input.seq_len,
                                                         preset.input.batch_size)  # fmt: skip
    assert cfg.model.decoder.vocab_size == 300
    assert "model vocab: 300 (the data's tokenizer; was 256)" in capsys.readouterr().err


def test_vocab_and_class_swap_mistakes_are_one_line_errors(tmp_path, capsys):
    from axplug.cli import main

    data = make_data(tmp_path / "d", documents(40, vocab=300), vocab=300)
    base = ["train", "--mesh-rule", "none", "--print-config"]
    cases = [
        (["--preset", "llama-tiny", "--input", f"token_file:path={str(data)!r}",
          "--set", "model.decoder.vocab_size=100"],
         "model.decoder.vocab_size: 100 is smaller than the data's vocabulary 300"),
        (["--preset", "llama2-7b"],
         "--preset llama2-7b has a 32000-token vocabulary but its input is bytes"),
        (["--preset", "llama-tiny", "--set", "input.klass=axplug.input.iterator:IteratorInput"],
         "input.klass: IteratorInput has its own Config"),
        (["--preset", "llama-tiny", "--input", "token_file"],
         "--input 'token_file': give path=... (e.g. --input token_file:path=VALUE)"),
        (["--preset", "llama-tiny", "--input", f"token_file:path={str(tmp_path)!r}"],
         "is not a prepared data directory"),
    ]  # fmt: skip
    for argv, message in cases:
        assert main([*base, *argv]) == 2, argv
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err, err
    assert main([*base, "--preset", "llama2-7b", "--allow-vocab-mismatch"]) == 0
    capsys.readouterr()


def test_eval_every_uses_the_inputs_held_out_split(tmp_path):
    from axplug.cli.main import build_parser
    from axplug.cli.train_cmd import build_config
    from axplug.summary import read_jsonl

    # The kit's gpt-tiny (bytes' 256-token vocabulary, 8 rows of 32 tokens): its train and
    # eval programs are other tests' (tests/test_trainer.py's eval), only the input differs.
    data = make_data(tmp_path / "d", documents(200, vocab=256), vocab=256)
    overrides = ("eval_every=2", "eval_batches=1", "summary_writers=[]",
                 "eval_input.eval_fraction=0.5")  # fmt: skip
    args = tiny_train_args(tmp_path / "run", *overrides, max_steps=4)
    args += ["--mesh-rule", "none", "--input", f"token_file:path={str(data)!r}"]
    cfg = build_config(build_parser().parse_args(args))
    assert cfg.eval_input.split == "eval" and cfg.eval_input.eval_fraction == 0.5
    from axplug.summary import JsonlWriter

    trainer = cfg.clone(summary_writers=[JsonlWriter.default_config()]).instantiate()
    assert trainer.eval_input.meta["shards"] and trainer.eval_input._config.split == "eval"
    trainer.run()
    evals = [r for r in read_jsonl(tmp_path / "run" / "metrics.jsonl") if "eval_loss" in r]
    assert [r["step"] for r in evals] == [2, 4] and all(r["eval_loss"] > 0 for r in evals)
    # Without an eval_input the trainer derives one from an input that has a split...
    bytes_args = ["--preset", "gpt-tiny", "--mesh-rule", "none", "--output-dir", str(tmp_path)]
    bytes_cfg = build_config(parse(*bytes_args, "--set", "eval_every=5"))
    assert bytes_cfg.eval_input is None
    assert bytes_cfg.instantiate().eval_input._config.split == "eval"
    # ...and refuses one without.
    from axplug.config import ConfigError
    from axplug.input import SyntheticInput

    synthetic = bytes_cfg.clone(input=SyntheticInput.default_config().set(vocab_size=256))
    with pytest.raises(ConfigError, match="eval_every: SyntheticInput has no eval split"):
        synthetic.instantiate()


def test_train_on_prepared_text_then_generate_text(tmp_path, capsys):
    pytest.importorskip("tokenizers")
    from axplug.cli import main
    from axplug.input import bundled_corpus_path
    from axplug.input.prepare import prepare_data
    from axplug.tokenizer import load_tokenizer
    from tokenizer_files import hf_bpe

    data = tmp_path / "data"
    prepare_data([bundled_corpus_path()], tokenizer=hf_bpe(tmp_path / "tok"), output=data,
                 text_unit="paragraph", docs_per_shard=1000, workers=1)  # fmt: skip
    run = str(tmp_path / "run")
    args = tiny_train_args(run, max_steps=3)
    args += ["--mesh-rule", "none", "--input", f"token_file:path={str(data)!r},packing=True"]
    assert main([*args, "-q"]) == 0
    capsys.readouterr()
    argv = ["generate", "--checkpoint", run, "--prompt", "HAMLET. To be", "--max-new-tokens",
            "8", "--temperature", "0"]  # fmt: skip
    assert main([*argv, "--json"]) == 0
    ids = json.loads(capsys.readouterr().out)
    tok = load_tokenizer(data)  # the data's tokenizer, found through the run's input config
    assert ids["prompt_ids"] == tok.encode("HAMLET. To be")
    assert main(argv) == 0
    assert capsys.readouterr().out.strip() == tok.decode(ids["prompt_ids"] + ids["output_ids"])
