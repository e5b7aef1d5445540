"""The ViT tower against transformers' CLIP and SigLIP vision models (tiny, random, every norm
and bias perturbed so a swap shows) and against a plain-numpy ViT on the same weights, and the
tower's config errors."""

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


def _erf(x):
    from math import erf

    return np.vectorize(erf)(x)


ACTIVATIONS = {
    "quick_gelu": lambda x: x / (1 + np.exp(-1.702 * x)),
    "gelu": lambda x: 0.5 * x * (1 + _erf(x / np.sqrt(2))),
    "gelu_pytorch_tanh": lambda x: (
        0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x**3)))
    ),
}


def numpy_vit(w, config, pixels):
    """ViT (Dosovitskiy et al.) in float64 numpy from the checkpoint's tensors: stride-p
    patches, [class token], positions, [pre-LN], L x (x + MHA(LN x); x + MLP(LN x)), and the
    post-LN on every token (SigLIP) or none (CLIP's is on its pooled token)."""
    w = {k.removeprefix("vision_model."): v.astype(np.float64) for k, v in w.items()}
    d, p, heads = config.hidden_size, config.patch_size, config.num_attention_heads
    act = ACTIVATIONS[config.hidden_act]

    def norm(x, name):
        mu, var = x.mean(-1, keepdims=True), x.var(-1, keepdims=True)
        return (x - mu) / np.sqrt(var + config.layer_norm_eps) * w[f"{name}.weight"] + w[
            f"{name}.bias"
        ]

    def linear(x, name):
        return x @ w[f"{name}.weight"].T + w[f"{name}.bias"]

    b, c, h, width = pixels.shape
    grid = pixels.astype(np.float64).reshape(b, c, h // p, p, width // p, p)
    patches = grid.transpose(0, 2, 4, 1, 3, 5).reshape(b, -1, c * p * p)
    x = patches @ w["embeddings.patch_embedding.weight"].reshape(d, -1).T
    x = x + w.get("embeddings.patch_embedding.bias", 0.0)
    if "embeddings.class_embedding" in w:
        x = np.concatenate([np.broadcast_to(w["embeddings.class_embedding"], (b, 1, d)), x], 1)
    x = x + w["embeddings.position_embedding.weight"]
    if "pre_layrnorm.weight" in w:
        x = norm(x, "pre_layrnorm")
    for i in range(config.num_hidden_layers):
        at = f"encoder.layers.{i}"
        y = norm(x, f"{at}.layer_norm1")
        q, k, v = (linear(y, f"{at}.self_attn.{n}_proj").reshape(b, -1, heads, d // heads)
                   for n in "qkv")  # fmt: skip
        scores = np.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(d // heads)
        probs = np.exp(scores - scores.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        heads_out = np.einsum("bhqk,bkhd->bqhd", probs, v).reshape(b, -1, d)
        x = x + linear(heads_out, f"{at}.self_attn.out_proj")
        y = norm(x, f"{at}.layer_norm2")
        x = x + linear(act(linear(y, f"{at}.mlp.fc1")), f"{at}.mlp.fc2")
    return norm(x, "post_layernorm") if "embeddings.class_embedding" not in w else x


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
    np.testing.assert_allclose(hidden, numpy_vit(state, config, pixels), rtol=0, atol=1e-5)
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
