"""Core layers; plugins fill their child slots (position transform, kernel, feed-forward...)."""

from axplug.api import EMPTY_POSITION, AttentionMask, Initializer, ParameterSpec, linear_bias
from axplug.layers.attention import (
    Attention,
    DotProductKernel,
    IdentityPositionTransform,
    QKVLinear,
)
from axplug.layers.base import BaseLayer
from axplug.layers.basic import Embedding, Linear
from axplug.layers.decoder import CausalLM, Decoder, cross_entropy
from axplug.layers.feed_forward import ACTIVATIONS, FeedForward, get_activation
from axplug.layers.flash import BlockwiseAttention, FlashAttention, FlashAttentionModifier
from axplug.layers.kv_cache import ContiguousKVCache, PagedKVCache
from axplug.layers.norm import LayerNorm, RMSNorm
from axplug.layers.pipeline import PipelinedTransformer
from axplug.layers.quantized import QuantizedLinear
from axplug.layers.stack import REMAT_POLICIES, RepeatedTransformer, StackedTransformer
from axplug.layers.transformer import TransformerLayer

__all__ = [
    "ACTIVATIONS",
    "EMPTY_POSITION",
    "Initializer",
    "linear_bias",
    "REMAT_POLICIES",
    "Attention",
    "BlockwiseAttention",
    "FlashAttention",
    "FlashAttentionModifier",
    "AttentionMask",
    "BaseLayer",
    "CausalLM",
    "ContiguousKVCache",
    "Decoder",
    "DotProductKernel",
    "Embedding",
    "FeedForward",
    "IdentityPositionTransform",
    "LayerNorm",
    "Linear",
    "PagedKVCache",
    "PipelinedTransformer",
    "ParameterSpec",
    "QKVLinear",
    "QuantizedLinear",
    "RMSNorm",
    "RepeatedTransformer",
    "StackedTransformer",
    "TransformerLayer",
    "cross_entropy",
    "get_activation",
]
