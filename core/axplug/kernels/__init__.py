"""Attention kernels: the protocol, the reference and XLA kernels, dispatch, and the
`FlashAttention` slot with its `flash_attention` modifier.

Hardware plugins implement the protocol (`AttentionKernel`, `Unsupported`, `check_shapes`)
against this package alone and wrap their opaque calls with `shard_over_batch`; dispatch asks
every `axplug.kernels` entry, by priority, whether it supports a call and falls back to the
reference kernel.
"""

from axplug.kernels.blockwise import BlockwiseKernel, blockwise_attention
from axplug.kernels.dispatch import (
    FALLBACK,
    KernelChoice,
    describe_kernels,
    kernel_choices,
    registered_kernels,
    select_kernel,
)
from axplug.kernels.layer import BlockwiseAttention, FlashAttention
from axplug.kernels.modifier import FlashAttentionModifier
from axplug.kernels.paged import (
    XlaPagedKernel,
    check_paged_shapes,
    paged_attention_xla,
    select_paged_kernel,
)
from axplug.kernels.partition import attention_specs, check_sequence_sharding, shard_over_batch
from axplug.kernels.protocol import AttentionKernel, Unsupported, check_shapes
from axplug.kernels.reference import ReferenceKernel, reference_attention
from axplug.kernels.xla import XlaKernel

__all__ = [
    "FALLBACK",
    "AttentionKernel",
    "BlockwiseAttention",
    "BlockwiseKernel",
    "FlashAttention",
    "FlashAttentionModifier",
    "KernelChoice",
    "ReferenceKernel",
    "Unsupported",
    "XlaKernel",
    "XlaPagedKernel",
    "check_paged_shapes",
    "paged_attention_xla",
    "select_paged_kernel",
    "attention_specs",
    "blockwise_attention",
    "check_sequence_sharding",
    "check_shapes",
    "describe_kernels",
    "kernel_choices",
    "reference_attention",
    "registered_kernels",
    "select_kernel",
    "shard_over_batch",
]
