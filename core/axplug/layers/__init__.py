"""Core layers; plugins fill their child slots (position transform, kernel, feed-forward...)."""

from axplug.context import OutputCollection, functional, side_input, side_inputs
from axplug.layers.attention import (
    Attention,
    AttentionKernelSlot,
    DotProductKernel,
    IdentityPositionTransform,
    QKVLinear,
)
from axplug.layers.base import BaseLayer
from axplug.layers.basic import Embedding, Linear
from axplug.layers.decoder import CausalLM, Decoder, cross_entropy
from axplug.layers.feed_forward import (
    ACTIVATIONS,
    HF_ACTIVATIONS,
    FeedForward,
    get_activation,
    hf_activation,
)
from axplug.layers.flash import BlockwiseAttention, FlashAttention, FlashAttentionModifier
from axplug.layers.fold import fold_layers, folded_config
from axplug.layers.kv_cache import ContiguousKVCache, KVCache, PagedKVCache
from axplug.layers.norm import LayerNorm, RMSNorm
from axplug.layers.stack import (
    REMAT_POLICIES,
    RepeatedTransformer,
    StackedTransformer,
    merge_collections,
    remat_children,
    remat_layer,
    scan_layer,
)
from axplug.layers.transformer import RESIDUAL_AXES, TransformerLayer

__all__ = [
    "fold_layers",
    "folded_config",
    "ACTIVATIONS",
    "HF_ACTIVATIONS",
    "hf_activation",
    "REMAT_POLICIES",
    "RESIDUAL_AXES",
    "Attention",
    "AttentionKernelSlot",
    "BlockwiseAttention",
    "FlashAttention",
    "FlashAttentionModifier",
    "BaseLayer",
    "CausalLM",
    "ContiguousKVCache",
    "KVCache",
    "Decoder",
    "DotProductKernel",
    "Embedding",
    "FeedForward",
    "IdentityPositionTransform",
    "LayerNorm",
    "OutputCollection",
    "functional",
    "Linear",
    "PagedKVCache",
    "QKVLinear",
    "RMSNorm",
    "RepeatedTransformer",
    "StackedTransformer",
    "TransformerLayer",
    "cross_entropy",
    "get_activation",
    "merge_collections",
    "remat_layer",
    "remat_children",
    "scan_layer",
    "side_input",
    "side_inputs",
]
