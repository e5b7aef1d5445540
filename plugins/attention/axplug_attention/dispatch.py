"""Kernel dispatch and the `FlashAttention` slot, now in `axplug.kernels` and `axplug.layers`.

Re-exported so `axplug_attention.dispatch:FlashAttention` in saved configs (`config.txt`,
`to_dict` output) and existing imports keep resolving.
"""

from axplug.api.kernels import (
    FALLBACK,
    KernelChoice,
    describe_kernels,
    kernel_choices,
    registered_kernels,
    select_kernel,
)
from axplug.api.layers import FlashAttention

__all__ = [
    "FALLBACK",
    "FlashAttention",
    "KernelChoice",
    "registered_kernels",
    "kernel_choices",
    "select_kernel",
    "describe_kernels",
]
