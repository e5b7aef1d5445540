"""axplug-gpu: NVIDIA device specs, mesh rules and cuDNN / Pallas flash-attention kernels.

Nothing registers by side effect: the core finds the components through pyproject entry points.
"""

from axplug_gpu.kernels import CudnnFlashKernel, PallasGpuFlashKernel
from axplug_gpu.paged import PallasGpuPagedKernel
from axplug_gpu.specs import A100, B200, H100, H200, SPECS

__version__ = "0.1.0"

__all__ = [
    "PallasGpuPagedKernel",
    "A100",
    "B200",
    "CudnnFlashKernel",
    "H100",
    "H200",
    "PallasGpuFlashKernel",
    "SPECS",
]
