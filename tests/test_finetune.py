"""Fine-tuning and recipes: `train --from RUN`, `--config FILE`, `--preset module:function`,
config.json with provenance, and resuming with another model refused."""

import json

import jax
import numpy as np
import pytest
from axplug_testing import tiny_train_args

from axplug.cli import main
from axplug.cli.main import build_parser
from axplug.cli.train_cmd import build_config
from test_hf_import import hf_weights, llama_config, write_hf

# A fine-tune's model is its checkpoint's, so not `tiny_train_args`: only what keeps it small
# (one device among them).
SMALL = ["--set", "compilation_cache_dir=None", "--set", "input.seq_len=16",
         "--set", "input.batch_size=8", "--mesh-rule", "none", "--modifier", "mesh",
         "-q"]  # fmt: skip


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    """(run directory, HF weights) of an import the tests only read. On one device: saved
    from all 8, its replicated arrays compiled a slice program per shape (56), and what was
    saved is the same. (`import-hf` itself: tests/test_hf_import.py.)"""
    from axplug.interop import import_hf

    root = tmp_path_factory.mktemp("imported")
    cfg = llama_config()
    weights = hf_weights(cfg)
    out = str(root / "imported")
    import_hf(write_hf(root / "hf", cfg, weights), out, devices=jax.devices()[:1])
    return out, weights


def trainer_for(argv):
    return build_config(build_parser().parse_args(["train", *argv])).instantiate()


def test_from_an_import_starts_at_its_weights_with_a_fresh_optimizer(tmp_path, imported):
    source, weights = imported
    argv = ["--from", source, "--output-dir", str(tmp_path / "ft"), "--input",
            "synthetic:vocab_size=96", *SMALL]  # fmt: skip
    trainer = trainer_for(argv)
    assert trainer._config.restore.init_from == source
    state = trainer.restore_or_init()
    np.testing.assert_array_equal(
        np.asarray(state["params"]["decoder"]["embedding"]["weight"]),
        weights["model.embed_tokens.weight"],
    )
    fresh = trainer.init_state()
    jax.tree.map(np.testing.assert_array_equal, state["opt_state"], fresh["opt_state"])
    assert int(state["step"]) == 0
    trainer.checkpointer.close()

    assert main(["train", *argv, "--max-steps", "3"]) == 0
    record = json.loads((tmp_path / "ft" / "config.json").read_text())
    assert record["provenance"]["source"] == f"--from {source}"
    assert record["provenance"]["input"] == "synthetic:vocab_size=96"
    assert (
        "axplug" in record["provenance"]["versions"] and "jax" in record["provenance"]["versions"]
    )
    # The fine-tune is a run of its own: rerunning resumes it, not the import.
    resumed = trainer_for([*argv, "--max-steps", "3"]).restore_or_init()
    assert int(resumed["step"]) == 3


def test_resume_optimizer_and_a_shape_changing_modifier(tmp_path, imported, capsys):
    source, _ = imported
    base = ["--from", source, "--input", "synthetic:vocab_size=96", *SMALL]
    first = tmp_path / "a"
    assert main(["train", *base, "--output-dir", str(first), "--max-steps", "2"]) == 0
    trainer = trainer_for(["--from", str(first), "--resume-optimizer", *SMALL,
                           "--output-dir", str(tmp_path / "b")])  # fmt: skip
    state = trainer.restore_or_init()
    assert int(state["step"]) == 0  # the fine-tune counts its own steps...
    counts = [x for x in jax.tree.leaves(state["opt_state"]) if np.ndim(x) == 0]
    assert any(int(c) == 2 for c in counts)  # ...with the source's optimizer state (2 updates)
    trainer.checkpointer.close()
    wider = [*base, "--output-dir", str(tmp_path / "c"), "--set", "model.decoder.dim=64"]
    assert main(["train", *wider]) == 1
    assert "params/decoder/embedding/weight: saved float32[96, 32], here float32[96, 64]" in (
        capsys.readouterr().err
    )


def test_config_file_and_recipe_presets(tmp_path, monkeypatch, capsys):
    run = tmp_path / "run"
    args = tiny_train_args(run, max_steps=1)  # the kit's gpt-tiny: its programs are compiled
    assert main([*args, "--mesh-rule", "none", "-q"]) == 0
    again = build_config(build_parser().parse_args(
        ["train", "--config", str(run / "config.json"), "--output-dir", str(run),
         "--mesh-rule", "none"]))  # fmt: skip
    from axplug.config import to_dict

    saved = json.loads((run / "config.json").read_text())["config"]
    assert to_dict(again) == saved and again.model.decoder.dim == 32

    (tmp_path / "my_recipes.py").write_text(
        "from axplug.presets import preset_config\n"
        "def small():\n"
        "    cfg = preset_config('gpt-tiny')\n"
        "    cfg.model.decoder.dim = 48\n"
        "    return cfg\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    argv = ["train", "--preset", "my_recipes:small", "--mesh-rule", "none", "--output-dir", "x"]
    cfg = build_config(build_parser().parse_args(argv))
    assert cfg.model.decoder.dim == 48 and cfg.output_dir == "x"
    assert main(["train", "--preset", "my_recipes:nothing", "--print-config"]) == 2
    assert "my_recipes:nothing" in capsys.readouterr().err


def test_an_untrusted_config_file_naming_outside_code_is_refused(tmp_path, capsys):
    from axplug.config import to_dict
    from axplug.presets import preset_config

    data = to_dict(preset_config("gpt-tiny"))
    data["input"]["klass"] = "os:system"
    (tmp_path / "c.json").write_text(json.dumps(data))
    assert main(["train", "--config", str(tmp_path / "c.json"), "--print-config"]) == 2
    err = capsys.readouterr().err
    assert "'os:system' names code outside axplug" in err and "Traceback" not in err
