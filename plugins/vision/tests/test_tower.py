"""The ViT tower against transformers' CLIP vision model (tiny, random, every norm perturbed)."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


def tiny_clip(**overrides):
    fields = dict(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        image_size=16, patch_size=4, num_channels=3, hidden_act="quick_gelu",
    )  # fmt: skip
    config = transformers.CLIPVisionConfig(**{**fields, **overrides})
    torch.manual_seed(0)
    model = transformers.CLIPVisionModel(config).float().train(False)
    with torch.no_grad():  # norms and biases away from their defaults: a swap shows
        for param in model.parameters():
            if param.ndim == 1:
                param.add_(torch.randn_like(param) * 0.1)
    return config, model


@pytest.mark.parametrize("act", ["quick_gelu", "gelu"])
def test_clip_tower_equals_transformers(act):
    import jax
    from axplug_vision.hf import clip_vision_config, clip_vision_params

    from axplug.api.layers import functional

    config, model = tiny_clip(hidden_act=act)
    pixels = np.random.default_rng(0).standard_normal((2, 3, 16, 16)).astype(np.float32)
    with torch.no_grad():
        out = model(pixel_values=torch.as_tensor(pixels))
    cfg = clip_vision_config(config.to_dict())
    tower = cfg.instantiate(parent=None)
    state = {k: v.numpy() for k, v in model.state_dict().items()}
    params = clip_vision_params(state, config.num_hidden_layers)
    specs = tower.create_parameter_specs_recursively()
    assert jax.tree.structure(specs, is_leaf=lambda s: hasattr(s, "shape")) == jax.tree.structure(
        params
    )

    @jax.jit
    def run(params, pixels):
        return functional(tower, prng_key=None, state=params, inputs=(pixels,), is_training=False)[
            0
        ]

    hidden, pooled = run(params, pixels)
    np.testing.assert_allclose(hidden, out.last_hidden_state.numpy(), rtol=0, atol=1e-5)
    np.testing.assert_allclose(pooled, out.pooler_output.numpy(), rtol=0, atol=1e-5)
