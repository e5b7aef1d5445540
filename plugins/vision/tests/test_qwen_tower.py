"""Qwen2.5-VL's vision tower against transformers' (tiny, random, every norm and bias
perturbed), over images whose grids split into several and partial windows, a two-frame
clip among them; its tensors' round trip, and its config and grid errors."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

VISION = dict(
    depth=4, fullatt_block_indexes=[1, 3], hidden_size=32, num_heads=4, intermediate_size=48,
    in_channels=3, patch_size=4, temporal_patch_size=2, spatial_merge_size=2, out_hidden_size=24,
    # 3x3 merged tokens: the first image's 4x6 merged grid is 4 windows, 3 of them partial.
    window_size=24,
    initializer_range=0.1,  # weights large enough that a wrong window or rotary shows
)  # fmt: skip
GRID_THW = np.array([[1, 8, 12], [1, 4, 4], [2, 4, 6]])


def tiny_qwen_tower():
    from transformers.models.qwen2_5_vl import modeling_qwen2_5_vl as qwen

    config = transformers.Qwen2_5_VLVisionConfig(**VISION)
    torch.manual_seed(0)
    model = qwen.Qwen2_5_VisionTransformerPretrainedModel(config).float().train(False)
    with torch.no_grad():
        for param in model.parameters():
            if param.ndim == 1:
                param.add_(torch.randn_like(param) * 0.1)
    return config, model


def test_qwen_tower_equals_transformers():
    import jax
    from axplug_vision.qwen_hf import qwen_tower_config, qwen_tower_params, qwen_tower_tensors
    from axplug_vision.qwen_tower import qwen_vision_inputs

    from axplug.api.interop import hf_tensors
    from axplug.api.layers import functional

    config, model = tiny_qwen_tower()
    num_patches = int(np.prod(GRID_THW, axis=1).sum())
    patches = np.random.default_rng(0).standard_normal((num_patches, 96)).astype(np.float32)
    with torch.no_grad():
        want = model(torch.as_tensor(patches), grid_thw=torch.as_tensor(GRID_THW)).pooler_output
    cfg = qwen_tower_config(config.to_dict())
    tower = cfg.instantiate(parent=None)
    state = {"model.visual." + k: v.numpy() for k, v in model.state_dict().items()}
    params = qwen_tower_params(state, cfg)
    specs = tower.create_parameter_specs_recursively()
    shapes = jax.tree.map(lambda s: tuple(s.shape), specs, is_leaf=lambda s: hasattr(s, "shape"))
    assert shapes == jax.tree.map(lambda a: a.shape, params)
    back = dict(hf_tensors({"tower": params}, qwen_tower_tensors(cfg, "tower", "model.visual.")))
    assert sorted(back) == sorted(state)
    for name, value in state.items():
        np.testing.assert_array_equal(back[name], value, err_msg=name)

    @jax.jit
    def run(params, inputs):
        return functional(tower, prng_key=None, state=params, inputs=inputs, is_training=False)[0]

    got = run(params, {"patches": patches, **qwen_vision_inputs(GRID_THW, cfg)})
    assert got.shape == (num_patches // 4, 24)
    np.testing.assert_allclose(got, want.numpy(), rtol=0, atol=1e-5)


def test_an_unknown_activation_and_a_grid_off_the_merge_blocks_are_errors():
    from axplug_vision.qwen_hf import qwen_tower_config
    from axplug_vision.qwen_tower import qwen_vision_inputs

    from axplug.api.config import ConfigError

    with pytest.raises(ConfigError, match="vision_config: hidden_act='swiglu'"):
        qwen_tower_config({**VISION, "hidden_act": "swiglu"})
    cfg = qwen_tower_config(VISION)
    with pytest.raises(ConfigError, match=r"grid_thw: \(1, 6, 5\) patches do not tile"):
        qwen_vision_inputs(np.array([[1, 6, 5]]), cfg)
