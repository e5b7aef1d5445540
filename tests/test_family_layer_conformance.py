"""The layer conformance kit (config round trip, specs, jit, gradients, the sharded run against
one device, a llama-tiny training run) on the layer options the model families need: q/k
norms, soft-capped scores, q/k/v biases, Gemma's (1 + w) norms and pre + post norms."""

import jax
import jax.numpy as jnp
import pytest
from axplug_testing import LayerConformance

from axplug.layers import Attention, QKVLinear, RMSNorm, TransformerLayer
from axplug.layers.attention import DotProductKernel

D, HEADS, HEAD_DIM = 16, 4, 6  # head_dim != D // HEADS: the norm widths differ from D


def _inputs():
    x = jax.random.normal(jax.random.PRNGKey(1), (4, 8, D), jnp.float32)
    return {"x": x, "positions": jnp.broadcast_to(jnp.arange(8), (4, 8))}


def _attention(**options):
    return Attention.default_config().set(
        input_dim=D, num_heads=HEADS, head_dim=HEAD_DIM, **options
    )


class TestGemmaAttentionConformance(LayerConformance):
    """Per-head (1 + w) q/k norms, a soft cap on the scores, the kernel's own scale, biases."""

    @pytest.fixture
    def layer_config(self):
        return _attention(
            qk_norm=RMSNorm.default_config().set(scale_offset=1.0),
            logit_softcap=5.0,
            kernel=DotProductKernel.default_config().set(scale=0.3),
            qkv=QKVLinear.default_config().set(bias=True),
        )

    @pytest.fixture
    def inputs(self):
        return _inputs()

    @pytest.fixture
    def swap_target(self):
        return Attention


class TestProjectionQKNormAttentionConformance(LayerConformance):
    """OLMo 2's q/k norms over the whole projections (before the split into heads)."""

    @pytest.fixture
    def layer_config(self):
        return _attention(qk_norm=RMSNorm.default_config(), qk_norm_over="projection")

    @pytest.fixture
    def inputs(self):
        return _inputs()

    @pytest.fixture
    def swap_target(self):
        return Attention


class TestSandwichNormLayerConformance(LayerConformance):
    """A transformer layer with pre and post norms around both branches (Gemma 2 / 3)."""

    @pytest.fixture
    def layer_config(self):
        layer = TransformerLayer.default_config().set(input_dim=D, post_norm=True)
        layer.norm.scale_offset = 1.0
        layer.attention.set(num_heads=HEADS)
        layer.feed_forward.hidden_dim = 32
        return layer

    @pytest.fixture
    def inputs(self):
        return _inputs()

    @pytest.fixture
    def swap_target(self):
        return TransformerLayer
