"""The layer conformance kit on the vision towers and projectors (no swap: no preset has
them)."""

import numpy as np
import pytest
from axplug_testing import LayerConformance


class VisionConformance(LayerConformance):
    """The kit's checks but the swap into a preset's language model."""

    capabilities = ("differentiable", "shardable")

    @pytest.fixture
    def swap_modifier(self):
        # The kit's default asks for a swap_target even where the swap check is skipped.
        return None


class TestVisionTransformerConformance(VisionConformance):
    @pytest.fixture
    def layer_config(self):
        from axplug_vision import VisionTransformer

        cfg = VisionTransformer.default_config().set(image_size=8, patch_size=4, dim=16)
        cfg.transformer.num_layers = 1
        cfg.transformer.layer.attention.num_heads = 2
        cfg.transformer.layer.feed_forward.hidden_dim = 32
        return cfg

    @pytest.fixture
    def inputs(self):
        return (np.random.default_rng(0).standard_normal((4, 3, 8, 8)).astype(np.float32),)


class TestQwenVisionTowerConformance(VisionConformance):
    @pytest.fixture
    def layer_config(self):
        from axplug_vision.qwen_tower import QwenVisionTower

        cfg = QwenVisionTower.default_config().set(patch_size=2, window_size=8, dim=16, out_dim=8)
        cfg.transformer.num_layers = 1
        cfg.transformer.layer.attention.num_heads = 2
        cfg.transformer.layer.feed_forward.hidden_dim = 32
        return cfg

    @pytest.fixture
    def inputs(self, layer_config):
        from axplug_vision.qwen_tower import qwen_vision_inputs

        grid_thw = np.array([[1, 4, 8], [1, 4, 4]])  # 48 patches of 3 * 2 * 2 * 2 values
        patches = np.random.default_rng(0).standard_normal((48, 24)).astype(np.float32)
        return {"patches": patches, **qwen_vision_inputs(grid_thw, layer_config)}


class TestMLPProjectorConformance(VisionConformance):
    @pytest.fixture
    def layer_config(self):
        from axplug_vision.projector import MLPProjector

        return MLPProjector.default_config().set(input_dim=16, output_dim=8)

    @pytest.fixture
    def inputs(self):
        return (np.random.default_rng(0).standard_normal((2, 5, 16)).astype(np.float32),)


class TestGemma3ProjectorConformance(VisionConformance):
    @pytest.fixture
    def layer_config(self):
        from axplug_vision.gemma3 import Gemma3Projector

        return Gemma3Projector.default_config().set(input_dim=16, output_dim=8, tokens_per_image=4)

    @pytest.fixture
    def inputs(self):  # a 4x4 grid of patches, pooled 2x2
        return (np.random.default_rng(0).standard_normal((2, 16, 16)).astype(np.float32),)
