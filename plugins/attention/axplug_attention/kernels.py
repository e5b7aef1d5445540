"""The attention-kernel protocol and the reference and XLA kernels, now in `axplug.kernels`.

Re-exported so `axplug_attention.kernels.ReferenceKernel` and friends keep working for
existing code and saved configs.
"""

from axplug.api import AttentionKernel, Unsupported, check_shapes
from axplug.api.kernels import ReferenceKernel, XlaKernel

__all__ = ["AttentionKernel", "Unsupported", "ReferenceKernel", "XlaKernel", "check_shapes"]
