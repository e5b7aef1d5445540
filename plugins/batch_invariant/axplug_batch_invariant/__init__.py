"""Batch-invariant layers: `--modifier batch_invariant` makes a token's logits the same bits
whatever shares its step (alone or batched, whole or chunked prefill, cached prefix or not)."""

from axplug_batch_invariant.layers import (
    BatchInvariantEmbedding,
    BatchInvariantFeedForward,
    BatchInvariantKernel,
    BatchInvariantLayerNorm,
    BatchInvariantLinear,
    BatchInvariantRMSNorm,
    attend_each_query,
    in_tiles,
    tiled_matmul,
)
from axplug_batch_invariant.modifier import BatchInvariantModifier

__all__ = [
    "BatchInvariantEmbedding",
    "BatchInvariantFeedForward",
    "BatchInvariantKernel",
    "BatchInvariantLayerNorm",
    "BatchInvariantLinear",
    "BatchInvariantModifier",
    "BatchInvariantRMSNorm",
    "attend_each_query",
    "in_tiles",
    "tiled_matmul",
]
