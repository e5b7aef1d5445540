"""The vision-language planning presets are the published models (less the tower layers whose
output no feature takes), and `axplug aot` plans a step with their images."""

import jax
import numpy as np
import pytest

from axplug.api.config import preset_config, resolve_preset

# Parameter counts of the published checkpoints (their safetensors index totals / 2 bytes),
# and the tower layers whose output no feature takes (read into no parameter).
PUBLISHED = {"llava-1.5-7b": (7_063_427_072, 1), "gemma3-4b-vision": (4_300_079_472, 0)}


@pytest.mark.parametrize("name", PUBLISHED)
def test_vision_preset_counts_what_transformers_builds(name):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    cfg = preset_config(name)
    shapes = jax.eval_shape(cfg.model.instantiate().initialize_parameters_recursively,
                            jax.random.PRNGKey(0))  # fmt: skip
    ours = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(shapes))
    raw = dict(resolve_preset(name).config_json)
    raw.pop("torch_dtype")
    config = transformers.AutoConfig.for_model(_model_type(raw), **raw)
    with torch.device("meta"):
        model = transformers.AutoModelForImageTextToText.from_config(config)
    theirs = sum(p.numel() for p in model.parameters())
    total, dropped = PUBLISHED[name]
    layers = config.vision_config.num_hidden_layers
    names = tuple(f"encoder.layers.{layers - 1 - i}." for i in range(dropped))
    unused = sum(p.numel() for n, p in model.named_parameters() if any(m in n for m in names))
    assert theirs == total
    assert ours == total - unused
    assert cfg.model.vision.transformer.num_layers == layers - dropped


def _model_type(raw):
    from axplug.api.interop import load_architecture

    return load_architecture(raw["architectures"][0]).model_type


# docs/vision.md's planning command (its test checks the page spells this).
AOT_ARGV = ["aot", "--preset", "llava-1.5-7b", "--mesh-rule", "gpu-h100-8x2", "--max-devices",
            "8", "--set", "input.batch_size=16", "--set", "input.seq_len=1024"]  # fmt: skip


def test_aot_plans_a_llava_step_with_its_images(capsys):
    pytest.importorskip("axplug_aot")
    import json

    from axplug_testing import cli_main as main

    main([*AOT_ARGV, "--json"])
    out, err = capsys.readouterr()
    assert out, err
    report = json.loads(out)
    # A device's rows hold every token's share of its image's pixels (336 x 336 x 3 over
    # 576 placeholders: 588 float32) beside its id and label.
    rows = 16 // report["num_devices"]
    assert report["memory"]["batch"] == rows * 1024 * (588 * 4 + 2 * 4)
