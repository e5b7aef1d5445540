"""The kernels face of the plugin API: the core kernels to fall back to, and kernel dispatch."""

from axplug import kernels as _kernels
from axplug.kernels import *  # noqa: F403

__all__ = [*_kernels.__all__]
