"""The ViT tower against transformers' CLIP and SigLIP vision models (tiny, random, every norm
and bias perturbed so a swap shows), and the tower's config errors."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

SHAPES = dict(
    hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
    image_size=16, patch_size=4, num_channels=3,
)  # fmt: skip
TOWERS = {
    "clip-quick_gelu": (transformers.CLIPVisionConfig, transformers.CLIPVisionModel, {}),
    "clip-gelu": (
        transformers.CLIPVisionConfig,
        transformers.CLIPVisionModel,
        {"hidden_act": "gelu"},
    ),
    "siglip": (
        transformers.SiglipVisionConfig,
        transformers.SiglipVisionModel,
        {"vision_use_head": False},
    ),
}


def tiny_tower(name):
    config_class, model_class, extra = TOWERS[name]
    config = config_class(**SHAPES, **extra)
    torch.manual_seed(0)
    model = model_class(config).float().train(False)
    with torch.no_grad():
        for param in model.parameters():
            if param.ndim == 1:
                param.add_(torch.randn_like(param) * 0.1)
    return config, model


@pytest.mark.parametrize("name", list(TOWERS))
def test_tower_equals_transformers(name):
    import jax
    from axplug_vision.hf import vision_tower_config, vision_tower_params

    from axplug.api.layers import functional

    config, model = tiny_tower(name)
    pixels = np.random.default_rng(0).standard_normal((2, 3, 16, 16)).astype(np.float32)
    with torch.no_grad():
        out = model(pixel_values=torch.as_tensor(pixels))
    cfg = vision_tower_config(config.to_dict())
    tower = cfg.instantiate(parent=None)
    state = {k: v.numpy() for k, v in model.state_dict().items()}
    params = vision_tower_params(state, cfg)
    specs = tower.create_parameter_specs_recursively()
    shapes = jax.tree.map(lambda s: tuple(s.shape), specs, is_leaf=lambda s: hasattr(s, "shape"))
    assert shapes == jax.tree.map(lambda a: a.shape, params)

    @jax.jit
    def run(params, pixels):
        inputs = (pixels,)
        return functional(tower, prng_key=None, state=params, inputs=inputs, is_training=False)[0]

    hidden, pooled = run(params, pixels)
    np.testing.assert_allclose(hidden, out.last_hidden_state.numpy(), rtol=0, atol=1e-5)
    if out.pooler_output is not None:  # SigLIP's comes from the attention head, not read
        np.testing.assert_allclose(pooled, out.pooler_output.numpy(), rtol=0, atol=1e-5)


def test_a_patch_that_does_not_tile_the_image_and_an_unknown_tower_are_errors():
    from axplug_vision import VisionTransformer
    from axplug_vision.hf import vision_tower_config

    from axplug.api.config import ConfigError

    cfg = VisionTransformer.default_config().set(image_size=16, patch_size=5, dim=8)
    with pytest.raises(ConfigError, match="patch_size: 5 does not divide image_size=16"):
        cfg.instantiate(parent=None)
    with pytest.raises(ConfigError, match="model_type='vit': not a vision tower"):
        vision_tower_config({"model_type": "vit"})
