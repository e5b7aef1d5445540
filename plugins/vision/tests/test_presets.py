"""The LLaVA 1.5 7B planning preset is the published model (less the tower's last layer, whose
output no feature takes), and `axplug aot` plans a step with its images."""

import jax
import numpy as np
import pytest

from axplug.api.config import preset_config, resolve_preset


def test_llava_preset_counts_what_transformers_builds_less_the_unused_layer():
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    cfg = preset_config("llava-1.5-7b")
    shapes = jax.eval_shape(cfg.model.instantiate().initialize_parameters_recursively,
                            jax.random.PRNGKey(0))  # fmt: skip
    ours = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(shapes))
    raw = {k: v for k, v in resolve_preset("llava-1.5-7b").config_json.items()
           if k not in ("architectures", "torch_dtype")}  # fmt: skip
    with torch.device("meta"):
        model = transformers.LlavaForConditionalGeneration(transformers.LlavaConfig(**raw))
    theirs = sum(p.numel() for p in model.parameters())
    last = sum(p.numel() for n, p in model.named_parameters() if "encoder.layers.23." in n)
    assert ours == theirs - last == 7_063_427_072 - last
    assert cfg.model.vision.transformer.num_layers == 23


def test_aot_plans_a_llava_step_with_its_images(capsys):
    pytest.importorskip("axplug_aot")
    import json

    from axplug_testing import cli_main as main

    argv = ["aot", "--preset", "llava-1.5-7b", "--mesh-rule", "gpu-h100-8x2",
            "--max-devices", "8", "--set", "input.batch_size=16", "--set",
            "input.seq_len=1024", "--json"]  # fmt: skip
    main(argv)
    out, err = capsys.readouterr()
    assert out, err
    report = json.loads(out)
    # A device's rows hold every token's share of its image's pixels (336 x 336 x 3 over
    # 576 placeholders: 588 float32) beside its id and label.
    rows = 16 // report["num_devices"]
    assert report["memory"]["batch"] == rows * 1024 * (588 * 4 + 2 * 4)
