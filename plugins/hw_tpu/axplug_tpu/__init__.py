"""axplug-tpu: Cloud TPU device specs, mesh rules, the Splash attention kernel and megablox's
grouped matmul.

Nothing registers by side effect: the core finds the components through pyproject entry points.
"""

from axplug_tpu.grouped import MegabloxGroupedMatmul
from axplug_tpu.kernels import SplashAttentionKernel
from axplug_tpu.paged import PallasTpuPagedKernel
from axplug_tpu.specs import SPECS, V4, V5E, V5P, V6E

__version__ = "0.1.0"

__all__ = [
    "MegabloxGroupedMatmul",
    "PallasTpuPagedKernel",
    "SPECS",
    "SplashAttentionKernel",
    "V4",
    "V5E",
    "V5P",
    "V6E",
]
