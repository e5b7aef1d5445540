"""axplug-trainium: AWS Trainium device specs, mesh rules and the NKI flash-attention kernel.

Nothing registers by side effect: the core finds the components through pyproject entry points.
"""

from axplug_trainium.kernels import NkiFlashKernel
from axplug_trainium.specs import SPECS, TRN1, TRN2

__version__ = "0.1.0"

__all__ = ["NkiFlashKernel", "SPECS", "TRN1", "TRN2"]
