"""The plugin API: the one package a plugin imports from the core.

`axplug.api` itself is the floor: the types plugins implement or pass, importing nothing of
the core. Kernels, layers, mesh rules and commands meet here: the attention mask and paged-KV
types a kernel is given, the kernel protocol, `ParameterSpec`, `DeviceSpec`, the shared
options of commands, and the declared type of each entry-point kind without a base class of
its own (checked when the registry loads a component). Everything here depends on jax and the
standard library only (its private rooms `axplug.api._*`), so any room of the core may import
it and no room needs another for a type.

Above the floor, each public submodule is a face a plugin builds with, by the names in its
`__all__`: `config`, `layers`, `kernels`, `sharding`, `interop`, `data`, `checkpoint`,
`summary`, `registry` and `run` (the Trainer and the Engine). A name has one door. Nothing
else of the core is API; `tests/test_layering.py` holds the first-party plugins and their
tests to that (docs/plugin-reference.md).
"""

from typing import TYPE_CHECKING

from axplug import PLUGIN_API_VERSION
from axplug import __version__ as CORE_VERSION
from axplug.api._face import lazy

if TYPE_CHECKING:
    from axplug.api._attention import EMPTY_POSITION, AttentionMask, PagedKV, linear_bias
    from axplug.api._commands import add_checkpoint_arguments, add_command, add_config_arguments
    from axplug.api._device import DeviceSpec, device_spec_of_rule, with_device_spec
    from axplug.api._errors import AxplugError
    from axplug.api._hf import HFArchitecture, HFFields, HFTensor
    from axplug.api._kernel import (
        AttentionKernel,
        Kernel,
        Unsupported,
        check_shapes,
        why_unsupported,
    )
    from axplug.api._kinds import CommandModule, MeshRuleFactory, RunInfo
    from axplug.api._parameters import PARAMETER_UPDATES, Initializer, ParameterSpec
    from axplug.hookspecs import hookimpl

# Where each name lives. Read on first use (PEP 562), so that a command module can take
# `add_checkpoint_arguments` without importing jax: `axplug --help` imports every core command.
_HOMES = {
    **dict.fromkeys(("EMPTY_POSITION", "AttentionMask", "PagedKV", "linear_bias"), "_attention"),
    **dict.fromkeys(
        ("add_checkpoint_arguments", "add_command", "add_config_arguments"), "_commands"
    ),
    "AxplugError": "_errors",
    **dict.fromkeys(("DeviceSpec", "device_spec_of_rule", "with_device_spec"), "_device"),
    **dict.fromkeys(
        ("AttentionKernel", "Kernel", "Unsupported", "check_shapes", "why_unsupported"), "_kernel"
    ),
    **dict.fromkeys(("CommandModule", "MeshRuleFactory", "RunInfo"), "_kinds"),
    **dict.fromkeys(("HFArchitecture", "HFFields", "HFTensor"), "_hf"),
    **dict.fromkeys(("PARAMETER_UPDATES", "Initializer", "ParameterSpec"), "_parameters"),
}


__getattr__ = lazy(__name__, {**_HOMES, "hookimpl": "axplug.hookspecs"})


__all__ = [
    "CORE_VERSION",
    "PLUGIN_API_VERSION",
    "EMPTY_POSITION",
    "PARAMETER_UPDATES",
    "AttentionKernel",
    "AxplugError",
    "CommandModule",
    "HFArchitecture",
    "HFFields",
    "HFTensor",
    "MeshRuleFactory",
    "RunInfo",
    "AttentionMask",
    "DeviceSpec",
    "Initializer",
    "Kernel",
    "PagedKV",
    "ParameterSpec",
    "Unsupported",
    "add_checkpoint_arguments",
    "add_command",
    "add_config_arguments",
    "check_shapes",
    "device_spec_of_rule",
    "hookimpl",
    "linear_bias",
    "why_unsupported",
    "with_device_spec",
]


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
