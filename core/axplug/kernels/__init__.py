"""Kernels and their dispatch: attention (reference, XLA, blockwise), paged attention, and
grouped matmuls.

Hardware plugins implement the protocol (`AttentionKernel`, `Unsupported`, `check_shapes`)
against `axplug.api` alone and wrap their opaque calls with `shard_over_batch`; dispatch asks
every `axplug.kernels` entry, by priority, whether it supports a call and falls back to the
reference kernel.
"""

from axplug.kernels.blockwise import (
    BlockwiseKernel,
    blockwise_attention,
    blockwise_backward_lse,
    blockwise_forward_lse,
)
from axplug.kernels.dispatch import (
    FALLBACK,
    KernelChoice,
    describe_kernels,
    kernel_choices,
    registered_kernels,
    select_kernel,
)
from axplug.kernels.grouped import (
    GroupedMatmulKernel,
    XlaGroupedMatmul,
    grouped_matmul,
    grouped_matmul_reference,
    select_grouped_matmul,
)
from axplug.kernels.paged import (
    PagedAttentionKernel,
    XlaPagedKernel,
    check_paged_shapes,
    paged_attention_xla,
    select_paged_kernel,
)
from axplug.kernels.partition import attention_specs, check_sequence_sharding, shard_over_batch
from axplug.kernels.reference import ReferenceKernel, reference_attention
from axplug.kernels.xla import XlaKernel

__all__ = [
    "FALLBACK",
    "BlockwiseKernel",
    "GroupedMatmulKernel",
    "XlaGroupedMatmul",
    "grouped_matmul",
    "grouped_matmul_reference",
    "select_grouped_matmul",
    "KernelChoice",
    "ReferenceKernel",
    "XlaKernel",
    "PagedAttentionKernel",
    "XlaPagedKernel",
    "check_paged_shapes",
    "paged_attention_xla",
    "select_paged_kernel",
    "attention_specs",
    "blockwise_attention",
    "blockwise_backward_lse",
    "blockwise_forward_lse",
    "check_sequence_sharding",
    "describe_kernels",
    "kernel_choices",
    "reference_attention",
    "registered_kernels",
    "select_kernel",
    "shard_over_batch",
]
