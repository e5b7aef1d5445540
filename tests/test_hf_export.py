"""`export_hf`: the inverse of import_hf, exact for an unmodified import and after fine-tuning."""

import json

import numpy as np
import pytest
from safetensors.numpy import load_file

from axplug.cli import main
from axplug.interop.hf_export import export_hf
from test_hf_import import hf_weights, llama_config, write_hf


def read_dir(directory) -> dict:
    out = {}
    for path in sorted(directory.glob("*.safetensors")):
        out.update(load_file(str(path)))
    return out


def test_export_of_an_import_equals_the_original_tensors(tmp_path, capsys):
    cfg = llama_config()
    weights = hf_weights(cfg)
    src = write_hf(tmp_path / "hf", cfg, weights, shards=2)
    run = str(tmp_path / "run")
    assert main(["import-hf", src, "--output", run]) == 0
    capsys.readouterr()
    raw = export_hf(run, str(tmp_path / "out"), shard_bytes=20_000)
    got = read_dir(tmp_path / "out")
    assert sorted(got) == sorted(weights)
    for name, value in weights.items():
        np.testing.assert_array_equal(got[name], value, err_msg=name)
        assert got[name].dtype == value.dtype
    assert len(list((tmp_path / "out").glob("*.safetensors"))) > 1  # sharded, with an index
    saved = json.loads((tmp_path / "out" / "config.json").read_text())
    assert saved == raw and all(saved[k] == v for k, v in cfg.items() if k != "torch_dtype")


def test_import_fine_tune_export_import_is_exact(tmp_path, capsys):
    import jax

    from test_finetune import SMALL
    from test_hf_import import load_run

    cfg = llama_config()
    src = write_hf(tmp_path / "hf", cfg, hf_weights(cfg))
    base, tuned = str(tmp_path / "base"), str(tmp_path / "tuned")
    assert main(["import-hf", src, "--output", base]) == 0
    assert main(["train", "--from", base, "--output-dir", tuned, "--max-steps", "20",
                 "--input", "synthetic:vocab_size=96", *SMALL]) == 0  # fmt: skip
    assert main(["export-hf", tuned, "--output", str(tmp_path / "out")]) == 0
    assert "wrote" in capsys.readouterr().out
    again = str(tmp_path / "again")
    assert main(["import-hf", str(tmp_path / "out"), "--output", again]) == 0
    _, step, tuned_state, _ = load_run(tuned)
    _, _, again_state, _ = load_run(again)
    _, _, base_state, _ = load_run(base)
    assert step == 20
    jax.tree.map(np.testing.assert_array_equal, again_state["params"], tuned_state["params"])
    moved = jax.tree.map(lambda a, b: bool((np.asarray(a) != np.asarray(b)).any()),
                         tuned_state["params"], base_state["params"])  # fmt: skip
    assert all(jax.tree.leaves(moved)), "fine-tuning changed every parameter"


def test_a_preset_trained_llama_exports_and_a_gpt_is_refused_by_name(
    tmp_path, capsys, trained_run, gpt_tiny_trained
):
    llama_tiny_trained = trained_run("llama-tiny", "input.seq_len=64")
    assert main(["export-hf", str(llama_tiny_trained), "--output", str(tmp_path / "out")]) == 0
    saved = json.loads((tmp_path / "out" / "config.json").read_text())
    # llama-tiny's vocabulary, its layers as the tests' tiny runs shrink them
    assert saved["num_hidden_layers"] == 2 and saved["vocab_size"] == 256
    capsys.readouterr()
    assert main(["export-hf", str(gpt_tiny_trained), "--output", str(tmp_path / "g")]) == 2
    err = capsys.readouterr().err
    assert "cannot export this model:" in err and "as LlamaForCausalLM: " in err
    assert "layer_norm_eps" in err  # a LayerNorm: no LLaMA-layout family reads its field


@pytest.mark.slow  # ~25 s; axplug-moe's test_mixtral_transformers exports against transformers
def test_mixtral_round_trips_through_the_moe_plugins_mapping(tmp_path, capsys):
    import jax
    import pytest

    pytest.importorskip("axplug_moe")
    from test_finetune import SMALL
    from test_hf_import import load_run, mixtral_config

    cfg = mixtral_config()
    weights = hf_weights(cfg)
    src = write_hf(tmp_path / "hf", cfg, weights)
    base, tuned = str(tmp_path / "base"), str(tmp_path / "tuned")
    assert main(["import-hf", src, "--output", base]) == 0
    raw = export_hf(base, str(tmp_path / "same"))
    got = read_dir(tmp_path / "same")
    assert sorted(got) == sorted(weights)
    for name, value in weights.items():
        np.testing.assert_array_equal(got[name], value, err_msg=name)
    assert raw["architectures"] == ["MixtralForCausalLM"]
    for key in ("num_local_experts", "num_experts_per_tok"):
        assert raw[key] == cfg[key]
    assert raw["router_aux_loss_coef"] == pytest.approx(cfg.get("router_aux_loss_coef", 0.001))

    vocab = cfg["vocab_size"]
    assert main(["train", "--from", base, "--output-dir", tuned, "--max-steps", "20",
                 "--input", f"synthetic:vocab_size={vocab}", *SMALL]) == 0  # fmt: skip
    assert main(["export-hf", tuned, "--output", str(tmp_path / "out")]) == 0
    again = str(tmp_path / "again")
    assert main(["import-hf", str(tmp_path / "out"), "--output", again]) == 0
    capsys.readouterr()
    _, _, tuned_state, _ = load_run(tuned)
    _, _, again_state, _ = load_run(again)
    jax.tree.map(np.testing.assert_array_equal, again_state["params"], tuned_state["params"])


def test_a_moe_that_mixtral_cannot_express_is_refused_by_name(tmp_path, capsys):
    import pytest

    pytest.importorskip("axplug_moe")
    from axplug_testing import tiny_train_args

    run = str(tmp_path / "moe")
    assert main(tiny_train_args(run, "model.decoder.transformer.num_layers=1", "input.seq_len=16",
                                preset="moe-tiny", max_steps=1)) == 0  # fmt: skip
    capsys.readouterr()
    assert main(["export-hf", run, "--output", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "as MixtralForCausalLM: " in err and "capacity_factor=1.25" in err


def test_a_field_the_family_fixes_or_defaults_must_come_back_from_the_rebuild():
    # LLaMA has one attention_bias for q, k, v and o: a model with q/k/v biases alone would
    # be rebuilt with an o_proj bias too. Its layers re-read the same config.json, so only
    # what the rebuilt layers write back shows it (as for a field an architecture implies).
    import pytest

    from axplug.interop.hf_export import HFExportError, hf_config_for
    from axplug.presets import preset_config

    cfg = preset_config("llama-tiny")
    cfg.model.decoder.transformer.layer.attention.qkv.bias = True
    with pytest.raises(
        HFExportError,
        match=r"as LlamaForCausalLM: attention_bias=False \(a LlamaForCausalLM built from the "
        r"config.json has True\)",
    ):
        hf_config_for(cfg, {"architectures": ["LlamaForCausalLM"]})
    cfg.model.decoder.transformer.layer.attention.qkv.bias = False
    raw, arch = hf_config_for(cfg, {"architectures": ["LlamaForCausalLM"]})
    assert arch.architecture == "LlamaForCausalLM" and raw["attention_bias"] is False


def test_the_kernel_slot_is_free_but_its_scale_is_not():
    # A kernel is how attention runs (any computes the same); a scale other than the one the
    # architecture builds changes what it computes, which LLaMA's config.json cannot say.
    import pytest

    from axplug.interop.hf_export import HFExportError, hf_config_for
    from axplug.layers import FlashAttention
    from axplug.presets import preset_config

    cfg = preset_config("llama-tiny")
    attention = cfg.model.decoder.transformer.layer.attention
    attention.kernel = FlashAttention.default_config()
    raw, _ = hf_config_for(cfg, {"architectures": ["LlamaForCausalLM"]})  # another kernel
    assert raw["architectures"] == ["LlamaForCausalLM"]
    attention.kernel.scale = 0.3
    with pytest.raises(HFExportError, match=r"attention\.kernel\.scale: 0\.3 \(the architecture "):
        hf_config_for(cfg, {"architectures": ["LlamaForCausalLM"]})


def test_a_bias_free_layer_norm_exports_its_eps_and_no_bias_tensor():
    """Cohere's LayerNorms have no bias: the core's LayerNorm exports that option too."""
    from axplug.api import HFTensor
    from axplug.interop import norm_tensors
    from axplug.layers import LayerNorm

    cfg = LayerNorm.default_config().set(input_dim=8, eps=1e-6, bias=False)
    assert LayerNorm.hf_write(cfg) == {"layer_norm_eps": 1e-6}
    assert norm_tensors("decoder.output_norm", "model.norm", cfg) == {
        "decoder.output_norm.scale": HFTensor("model.norm.weight")
    }
