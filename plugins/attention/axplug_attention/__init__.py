"""axplug-attention: RoPE, GQA/MQA and sliding windows.

Kernel dispatch, the kernel protocol and the `flash_attention` modifier moved to the core
(`axplug.kernels`, `axplug.api`, `axplug.layers`); their names are re-exported here for
existing imports. Importing this package registers nothing by side effect: the core finds its
components through the entry points in pyproject.toml.
"""

from axplug_attention.dispatch import (
    FlashAttention,
    KernelChoice,
    describe_kernels,
    kernel_choices,
    registered_kernels,
    select_kernel,
)
from axplug_attention.gqa import GroupedQKVLinear
from axplug_attention.kernels import AttentionKernel, ReferenceKernel, Unsupported, XlaKernel
from axplug_attention.modifiers import (
    FlashAttentionModifier,
    GQAModifier,
    RopeModifier,
    SlidingWindowModifier,
)
from axplug_attention.rope import RotaryPositionTransform, apply_rope, rope_frequencies

__version__ = "0.1.0"

__all__ = [
    "AttentionKernel",
    "FlashAttention",
    "FlashAttentionModifier",
    "GQAModifier",
    "GroupedQKVLinear",
    "KernelChoice",
    "ReferenceKernel",
    "RopeModifier",
    "RotaryPositionTransform",
    "SlidingWindowModifier",
    "Unsupported",
    "XlaKernel",
    "apply_rope",
    "describe_kernels",
    "kernel_choices",
    "registered_kernels",
    "rope_frequencies",
    "select_kernel",
]
