"""The plugin API floor: the types plugins implement or pass, importing nothing of the core.

Kernels, layers, mesh rules and commands meet here: the attention mask and paged-KV types a
kernel is given, the kernel protocol, `ParameterSpec`, `DeviceSpec`, and the shared options of
commands. Everything here depends on jax and the standard library only, so any room of the
core may import it and no room needs another for a type (docs/plugin-reference.md).
"""

from axplug.api.attention import EMPTY_POSITION, AttentionMask, PagedKV, linear_bias
from axplug.api.commands import add_checkpoint_arguments
from axplug.api.device import DeviceSpec, with_device_spec
from axplug.api.kernel import AttentionKernel, Unsupported, check_shapes
from axplug.api.parameters import PARAMETER_UPDATES, Initializer, ParameterSpec
from axplug.hookspecs import hookimpl

__all__ = [
    "EMPTY_POSITION",
    "PARAMETER_UPDATES",
    "AttentionKernel",
    "AttentionMask",
    "DeviceSpec",
    "Initializer",
    "PagedKV",
    "ParameterSpec",
    "Unsupported",
    "add_checkpoint_arguments",
    "check_shapes",
    "hookimpl",
    "linear_bias",
    "with_device_spec",
]
