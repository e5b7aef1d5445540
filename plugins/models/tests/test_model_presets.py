"""The planning presets are the published models: built through their architecture from
config.json, they have the published parameter counts (and transformers' own count of the same
config.json), and `axplug aot` plans them."""

import jax
import numpy as np
import pytest

from axplug.api.config import preset_config, resolve_preset

# Parameter counts of the published checkpoints (their safetensors index totals / 2 bytes;
# Gemma 3: the text model of the 27B, without the vision tower).
PUBLISHED = {
    "mistral-7b": 7_241_732_096,
    "qwen2-7b": 7_615_616_512,
    "qwen3-8b": 8_190_735_360,
    "gemma-7b": 8_537_680_896,
    "olmo2-7b": 7_298_617_344,
    "phi3-mini": 3_821_079_552,
    "gemma3-27b": 27_009_346_304,
}


def parameter_count(cfg) -> int:
    model = cfg.model.instantiate()
    shapes = jax.eval_shape(model.initialize_parameters_recursively, jax.random.PRNGKey(0))
    return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(shapes))


def transformers_parameter_count(config_json: dict) -> int:
    """What transformers builds from the same config.json, on the meta device (no memory)."""
    pytest.importorskip("transformers")
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from axplug.api.interop import load_architecture

    raw = dict(config_json)
    model_type = load_architecture(raw["architectures"][0]).model_type
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **raw))
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("name", PUBLISHED)
def test_preset_has_the_published_parameter_count(name):
    cfg = preset_config(name)
    assert parameter_count(cfg) == PUBLISHED[name]
    assert cfg.model.compute_dtype == "bfloat16"


@pytest.mark.parametrize("name", PUBLISHED)
def test_preset_counts_what_transformers_builds_from_its_config_json(name):
    config_json = resolve_preset(name).config_json
    assert transformers_parameter_count(config_json) == PUBLISHED[name]


def test_aot_plans_a_family_preset_on_an_accelerator_rule(capsys):
    pytest.importorskip("axplug_aot")
    import json

    from axplug_testing import cli_main as main

    argv = ["aot", "--preset", "mistral-7b", "--mesh-rule", "gpu-h100-8x2", "--max-devices", "8",
            "--set", "input.batch_size=16", "--set", "input.seq_len=256", "--json"]  # fmt: skip
    main(argv)
    out, err = capsys.readouterr()
    assert out, err
    report = json.loads(out)
    assert report["memory"]["params"] > 0 and report["num_devices"] == 16
    # The analytic FLOPs are 6 N D plus attention: the published N, 16 x 256 tokens.
    dense = 6 * PUBLISHED["mistral-7b"] * 16 * 256
    assert 1.0 < report["flops_per_step_analytic"] / dense < 1.1
