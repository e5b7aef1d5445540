"""The MoE families against transformers itself (axplug_models.testing.check_against_transformers):
a tiny random model (1-d weights perturbed), `import-hf`, last-position logits within 1e-5,
16 greedy tokens equal, `export-hf` reloaded by AutoModelForCausalLM as the same class with
the same logits. Then what config.json cannot express is refused by name."""

import json

import pytest

transformers = pytest.importorskip("transformers")

from axplug_models.testing import check_against_transformers  # noqa: E402

from axplug.api.interop import HFImportError  # noqa: E402

TOL = 1e-5
SHAPES = dict(
    vocab_size=96,
    hidden_size=32,
    intermediate_size=64,
    moe_intermediate_size=16,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    num_experts=4,
    num_experts_per_tok=2,
    max_position_embeddings=128,
)


def config(name, **updates):
    return getattr(transformers, f"{name}Config")(**{**SHAPES, **updates})


# A family whose layers are all alike checks one: its layer, imported, decoded and exported, is
# the claim, and a second compiled every program's layer twice over. The sparse step keeps two
# layers (its period); so do the slow variants.
ONE_LAYER = dict(num_hidden_layers=1)

FAMILIES = {
    # Qwen2-MoE's defaults: top-k probabilities not renormalized, a gated shared expert.
    "qwen2-moe": lambda: config("Qwen2Moe", shared_expert_intermediate_size=48, **ONE_LAYER),
    "qwen2-moe-renormalized": lambda: config(
        "Qwen2Moe", shared_expert_intermediate_size=24, norm_topk_prob=True
    ),
    # Every second layer MoE, the others dense MLPs of intermediate_size (MoELayerGroup).
    "qwen2-moe-sparse-step-2": lambda: config(
        "Qwen2Moe", shared_expert_intermediate_size=48, decoder_sparse_step=2
    ),
    "qwen3-moe": lambda: config("Qwen3Moe", head_dim=16, norm_topk_prob=True, **ONE_LAYER),
    "qwen3-moe-raw-top-k": lambda: config("Qwen3Moe", norm_topk_prob=False),
    # Layer 0 dense by mlp_only_layers: the same period-2 mix, read as MoELayerGroups.
    "qwen3-moe-mlp-only-layers": lambda: config(
        "Qwen3Moe", norm_topk_prob=True, mlp_only_layers=[0]
    ),
}


# Variants of a family already covered (the other routing, a mix read another way): slow,
# as in axplug-models (`make test-all` runs them).
VARIANTS = ("qwen2-moe-renormalized", "qwen3-moe-raw-top-k", "qwen3-moe-mlp-only-layers")


@pytest.mark.parametrize(
    "family",
    [pytest.param(f, marks=pytest.mark.slow) if f in VARIANTS else f for f in FAMILIES],
)
def test_family_matches_transformers(family, tmp_path):
    check = check_against_transformers(FAMILIES[family](), tmp_path)
    assert not check.mismatches(TOL), check


def _saved(tmp_path, cfg):
    from axplug_models.testing import tiny_transformers_model

    directory = str(tmp_path / "hf")
    tiny_transformers_model(cfg).save_pretrained(directory)
    return directory


def _import(directory, tmp_path):
    from axplug.api.interop import hf_trainer_config, read_hf_config

    return hf_trainer_config(read_hf_config(directory), output_dir=str(tmp_path / "run"))


def test_qwen2_moe_reads_the_hub_names_and_writes_them_back(tmp_path):
    # Hub config.json: num_experts, no qkv_bias (transformers 4 had it fixed to True).
    from axplug_moe import MoEFeedForward

    from axplug.api.config import find_configs
    from axplug.api.interop import hf_config_for

    directory = _saved(tmp_path, config("Qwen2Moe", shared_expert_intermediate_size=48))
    path = f"{directory}/config.json"
    with open(path) as f:
        raw = json.load(f)
    del raw["qkv_bias"]
    with open(path, "w") as f:
        json.dump(raw, f)
    cfg = _import(directory, tmp_path)
    ((_, moe),) = find_configs(cfg, MoEFeedForward)
    assert (moe.num_experts, moe.hidden_dim, moe.num_shared_experts) == (4, 16, 1)
    assert (moe.shared_hidden_dim, moe.shared_expert_gate) == (48, True)
    router = moe.router
    assert (router.top_k, router.renormalize, router.capacity_factor) == (2, False, None)
    assert cfg.model.decoder.transformer.layer.attention.qkv.bias is True
    written, arch = hf_config_for(cfg, raw)
    assert arch.architecture == "Qwen2MoeForCausalLM"
    assert written["num_experts"] == 4 and written["shared_expert_intermediate_size"] == 48
    assert written["norm_topk_prob"] is False and written["qkv_bias"] is True
    assert written["decoder_sparse_step"] == 1 and written["mlp_only_layers"] == []
    for implied in ("shared_expert_gate", "attention_bias", "mlp_bias", "num_local_experts"):
        assert implied not in written


def test_qwen3_moe_reads_either_expert_count_name(tmp_path):
    # transformers 5 saves Qwen3-MoE's count as num_local_experts; hub files say num_experts.
    directory = _saved(tmp_path, config("Qwen3Moe", norm_topk_prob=True))
    path = f"{directory}/config.json"
    with open(path) as f:
        raw = json.load(f)
    assert raw["num_local_experts"] == 4 and "num_experts" not in raw
    _import(directory, tmp_path)
    raw["num_experts"] = raw.pop("num_local_experts")
    with open(path, "w") as f:
        json.dump(raw, f)
    _import(directory, tmp_path)
    raw["num_local_experts"] = 8
    with open(path, "w") as f:
        json.dump(raw, f)
    with pytest.raises(HFImportError, match="num_local_experts=8 and num_experts=4 disagree"):
        _import(directory, tmp_path)


@pytest.mark.parametrize(
    "updates, message",
    [
        (
            dict(mlp_only_layers=[1]),
            r"decoder_sparse_step=1 with mlp_only_layers=\[1\] over 2 layers makes layers "
            r"\[1\] dense",
        ),
        (dict(decoder_sparse_step=3, num_hidden_layers=4), r"makes layers \[0, 1, 3\] dense"),
    ],
)
def test_a_dense_and_moe_mix_that_does_not_repeat_is_refused_by_name(tmp_path, updates, message):
    directory = _saved(tmp_path, config("Qwen2Moe", shared_expert_intermediate_size=48, **updates))
    with pytest.raises(HFImportError, match=message):
        _import(directory, tmp_path)


def test_export_refuses_what_qwen2_moe_cannot_express(tmp_path):
    from axplug_moe import MoEFeedForward

    from axplug.api.config import find_configs
    from axplug.api.interop import HFExportError, hf_config_for

    directory = _saved(tmp_path, config("Qwen2Moe", shared_expert_intermediate_size=48))
    with open(f"{directory}/config.json") as f:
        raw = json.load(f)
    cfg = _import(directory, tmp_path)
    ((_, moe),) = find_configs(cfg, MoEFeedForward)
    moe.shared_expert_gate = False  # an ungated shared expert: Qwen2-MoE always gates it
    with pytest.raises(HFExportError, match=r"shared_expert_gate=False \(a Qwen2MoeForCausalLM"):
        hf_config_for(cfg, raw)
    moe.set(num_shared_experts=0, shared_expert_gate=False)  # none: Qwen2-MoE always has one
    with pytest.raises(HFExportError, match=r"shared_expert_intermediate_size=None"):
        hf_config_for(cfg, raw)


def test_mixtral_refuses_a_shared_expert(tmp_path):
    # A config.json's shared_expert_intermediate_size means nothing to Mixtral's code, and a
    # model with a shared expert does not export as one.
    from axplug_moe import MoEFeedForward

    from axplug.api.config import find_configs
    from axplug.api.interop import HFExportError, hf_config_for

    mixtral = transformers.MixtralConfig(
        **{k: v for k, v in SHAPES.items() if k not in ("num_experts", "moe_intermediate_size")},
        num_local_experts=4,
    )
    directory = _saved(tmp_path, mixtral)
    with open(f"{directory}/config.json") as f:
        raw = json.load(f)
    cfg = _import(directory, tmp_path)
    ((_, moe),) = find_configs(cfg, MoEFeedForward)
    assert moe.num_shared_experts == 0
    moe.set(num_shared_experts=1, shared_hidden_dim=8)
    with pytest.raises(HFExportError, match=r"as MixtralForCausalLM: .*shared_expert_"):
        hf_config_for(cfg, raw)
