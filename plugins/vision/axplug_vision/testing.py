"""Tiny random vision-language models made with transformers, for tests against it (this
distribution's `test` extra: torch and transformers, which the plugin itself never needs)."""

from __future__ import annotations

from typing import Any

__all__ = ["perturbed", "predicted", "tiny_llava"]


def perturbed(model: Any, *, scale: float = 0.1) -> Any:
    """`model` in float32 for inference, every 1-d weight (norms, biases) moved by noise from
    torch's generator as it stands: a dropped bias or two norms swapped then show."""
    import torch

    model = model.float().train(False)
    with torch.no_grad():
        for param in model.parameters():
            if param.ndim == 1:
                param.add_(torch.randn_like(param) * scale)
    return model


def tiny_llava(*, vocab_size: int = 96, image_token: int = 95, pad_token: int = 0,
               tower_layers: int = 3) -> Any:  # fmt: skip
    """A random `LlavaForConditionalGeneration`: LLaMA (2 layers, width 32, GQA 4/2) and a CLIP
    tower (width 24, 16-pixel images in 4-pixel patches: 16 features each), perturbed."""
    import torch
    import transformers

    text = transformers.LlamaConfig(
        vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, pad_token_id=pad_token,
    )  # fmt: skip
    vision = transformers.CLIPVisionConfig(
        hidden_size=24, intermediate_size=48, num_hidden_layers=tower_layers,
        num_attention_heads=4, image_size=16, patch_size=4,
    )  # fmt: skip
    config = transformers.LlavaConfig(
        vision_config=vision, text_config=text, image_token_index=image_token,
        image_seq_length=16,
    )  # fmt: skip
    torch.manual_seed(0)
    return perturbed(transformers.LlavaForConditionalGeneration(config))


def predicted(model: Any, params: Any, inputs: dict) -> Any:
    """`model.predict(**inputs)` (logits as numpy), jitted: one program, no op by op."""
    import jax
    import numpy as np

    from axplug.api.layers import functional

    @jax.jit
    def run(params, inputs):
        return functional(model, prng_key=None, state=params, inputs=inputs,
                          is_training=False, method="predict")[0]  # fmt: skip

    return np.asarray(run(params, inputs))
