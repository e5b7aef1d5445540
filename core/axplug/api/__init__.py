"""The plugin API floor: the types plugins implement or pass, importing nothing of the core.

Kernels, layers, mesh rules and commands meet here: the attention mask and paged-KV types a
kernel is given, the kernel protocol, `ParameterSpec`, `DeviceSpec`, the shared options of
commands, and the declared type of each entry-point kind without a base class of its own
(`kinds`: checked when the registry loads a component). Everything here depends on jax and
the standard library only, so any room of the core may import it and no room needs another
for a type (docs/plugin-reference.md).

Beyond the floor a plugin builds with the public faces in `PUBLIC_MODULES`, each by the names
in its `__all__`: the config tools, the core layers to compose or subclass, the kernels to
fall back to, the sharding scope, and the consumer faces (the inference engine, the testing
kit). Nothing else of the core is API; `tests/test_layering.py` holds the first-party plugins
to that.
"""

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from axplug.api.attention import EMPTY_POSITION, AttentionMask, PagedKV, linear_bias
    from axplug.api.commands import add_checkpoint_arguments, add_config_arguments
    from axplug.api.device import DeviceSpec, with_device_spec
    from axplug.api.errors import AxplugError
    from axplug.api.hf import HFArchitecture, HFFields, HFTensor
    from axplug.api.kernel import AttentionKernel, Unsupported, check_shapes
    from axplug.api.kinds import AttentionKernelLike, CommandModule, MeshRuleFactory, RunInfo
    from axplug.api.parameters import PARAMETER_UPDATES, Initializer, ParameterSpec
    from axplug.hookspecs import hookimpl

# Where each name lives. Read on first use (PEP 562), so that a command module can take
# `add_checkpoint_arguments` without importing jax: `axplug --help` imports every core command.
_HOMES = {
    **dict.fromkeys(("EMPTY_POSITION", "AttentionMask", "PagedKV", "linear_bias"), "attention"),
    **dict.fromkeys(("add_checkpoint_arguments", "add_config_arguments"), "commands"),
    "AxplugError": "errors",
    **dict.fromkeys(("DeviceSpec", "with_device_spec"), "device"),
    **dict.fromkeys(("AttentionKernel", "Unsupported", "check_shapes"), "kernel"),
    **dict.fromkeys(
        ("AttentionKernelLike", "CommandModule", "MeshRuleFactory", "RunInfo"), "kinds"
    ),
    **dict.fromkeys(("HFArchitecture", "HFFields", "HFTensor"), "hf"),
    **dict.fromkeys(("PARAMETER_UPDATES", "Initializer", "ParameterSpec"), "parameters"),
}


def __getattr__(name: str):
    if name == "hookimpl":
        from axplug.hookspecs import hookimpl

        return hookimpl
    if name not in _HOMES:
        raise AttributeError(f"module 'axplug.api' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(f"axplug.api.{_HOMES[name]}"), name)
    globals()[name] = value
    return value


# The core modules a plugin may import, by the names in their `__all__`.
PUBLIC_MODULES = (
    "axplug",
    "axplug.api",
    "axplug.config",
    "axplug.layers",
    "axplug.kernels",
    "axplug.sharding",
    "axplug.mesh_rules",
    "axplug.summary",
    "axplug.checkpoint",
    "axplug.files",
    "axplug.input",
    "axplug.optim",
    "axplug.tokenizer",
    "axplug.presets",
    "axplug.modifiers",
    "axplug.trainer",
    "axplug.inference",
    "axplug.interop",
    "axplug.testing",
)

__all__ = [
    "PUBLIC_MODULES",
    "EMPTY_POSITION",
    "PARAMETER_UPDATES",
    "AttentionKernel",
    "AttentionKernelLike",
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
    "PagedKV",
    "ParameterSpec",
    "Unsupported",
    "add_checkpoint_arguments",
    "add_config_arguments",
    "check_shapes",
    "hookimpl",
    "linear_bias",
    "with_device_spec",
]


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
