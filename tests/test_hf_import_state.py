"""What `axplug import-hf` writes and how runs start from it: parameters and step only, the
optimizer state marked fresh and created as `tx.init(params)` by whoever needs it, and the
checkpoint read one shard file at a time."""

import os

import jax
import numpy as np
import pytest

from axplug.checkpoint import Checkpointer
from axplug.cli import main
from axplug.interop import SafetensorsDir, hf_params
from axplug.interop.hf_config import load_architecture
from axplug.trainer.fresh_optimizer import has_fresh_opt_state
from test_finetune import SMALL, trainer_for
from test_hf_import import hf_weights, llama_config, load_run, write_hf


@pytest.fixture
def imported(tmp_path, capsys):
    """(run directory, Hugging Face directory) of a two-shard LLaMA import."""
    cfg = llama_config()
    src = write_hf(tmp_path / "hf", cfg, hf_weights(cfg), shards=2)
    out = str(tmp_path / "imported")
    assert main(["import-hf", src, "--output", out]) == 0
    capsys.readouterr()
    return out, src


def reference_state(trainer, src):
    """The state the import used to save: the checkpoint's weights read by the import's own
    rules, `tx.init` of them, step 0, on the trainer's layout."""
    rules = load_architecture("LlamaForCausalLM").tensors(trainer.config.model)
    with SafetensorsDir(src) as tensors:
        params = hf_params(tensors, rules, trainer.param_specs)
    shardings = trainer.layout.shardings
    params = jax.device_put(params, shardings["params"])
    opt_state = jax.jit(trainer.tx.init, out_shardings=shardings["opt_state"])(params)
    step = jax.device_put(np.int32(0), shardings["step"])
    return {"params": params, "opt_state": opt_state, "step": step}


def assert_same(actual, expected):
    assert jax.tree.structure(actual) == jax.tree.structure(expected)
    for a, e in zip(jax.tree.leaves(actual), jax.tree.leaves(expected), strict=True):
        assert a.dtype == e.dtype and a.shape == e.shape and a.sharding == e.sharding
        np.testing.assert_array_equal(np.asarray(a), np.asarray(e))


def test_the_import_saves_params_and_step_and_marks_its_optimizer_state_fresh(imported):
    out, _ = imported
    directory = f"{out}/checkpoints"
    with Checkpointer.default_config().set(directory=directory).instantiate() as checkpointer:
        metadata = checkpointer.metadata(0)
        saved = checkpointer.saved_checksums(0)
        assert checkpointer.verify(0) == len(saved)  # what is there reads back and checks
    assert has_fresh_opt_state(metadata) and metadata["opt_state"] == "fresh"
    assert {name.split("/")[0] for name in saved} == {"params", "step"}
    assert any(name.startswith("params/decoder/transformer/layer1/") for name in saved)


def test_resuming_the_import_gives_the_state_it_used_to_save(imported):
    out, src = imported
    trainer, step, _, _ = load_run(out)
    state = trainer.restore_or_init()  # the trainer's own resume, in the import's directory
    assert step == 0
    assert_same(state, reference_state(trainer, src))
    trainer.checkpointer.close()


def test_fine_tuning_with_the_imports_optimizer_takes_the_same_first_step(imported, tmp_path):
    out, src = imported
    argv = ["--from", out, "--resume-optimizer", "--input", "synthetic:vocab_size=96",
            "--output-dir", str(tmp_path / "ft"), *SMALL]  # fmt: skip
    trainer = trainer_for(argv)
    state = trainer.restore_or_init()
    reference = reference_state(trainer, src)
    assert_same(state, reference)
    assert_same(trainer.layout.fresh_opt_state(reference["params"]), reference["opt_state"])
    batch = trainer.put_batch(trainer.input.batch(0))
    want, _ = trainer._train_step(reference, batch)
    got, _ = trainer._train_step(state, batch)
    assert_same(got, want)
    fresh = reference_state(trainer, src)["opt_state"]  # `reference` was donated to the step
    moved = jax.tree.map(lambda a, b: bool((np.asarray(a) != np.asarray(b)).any()),
                         got["opt_state"], fresh)  # fmt: skip
    assert any(jax.tree.leaves(moved)), "the step updated the optimizer state"
    trainer.checkpointer.close()


def _mapped(path):
    with open("/proc/self/maps") as f:
        return any(line.rstrip().endswith(path) for line in f)


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="reads Linux's /proc")
def test_one_shard_file_is_open_at_a_time(tmp_path):
    cfg = llama_config()
    weights = hf_weights(cfg)
    src = write_hf(tmp_path / "hf", cfg, weights, shards=2)
    first, second = (str(tmp_path / "hf" / f"model-0000{i}-of-00002.safetensors") for i in (1, 2))
    a, b = sorted(weights)[:2]  # write_hf deals the sorted names out to the shards in turn
    tensors = SafetensorsDir(src)
    got_a = tensors.get(a)
    assert _mapped(first) and not _mapped(second)
    got_b = tensors.get(b)
    assert _mapped(second) and not _mapped(first)  # a memory-mapped shard stays resident
    np.testing.assert_array_equal(got_a, weights[a])  # arrays read before the close stay valid
    np.testing.assert_array_equal(tensors.get(a), weights[a])
    tensors.close()
    assert not _mapped(first) and not _mapped(second)
    np.testing.assert_array_equal(got_b, weights[b])
