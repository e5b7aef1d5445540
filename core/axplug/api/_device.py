"""`DeviceSpec`: the chip a mesh rule targets, attached to the rule with `with_device_spec`."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

__all__ = ["DeviceSpec", "device_spec_of_rule", "with_device_spec"]

_SPECS: dict[Callable, DeviceSpec] = {}


@dataclasses.dataclass(frozen=True)
class DeviceSpec:
    """One accelerator chip, from its vendor's public datasheet (`source`)."""

    name: str
    platform: str  # "gpu", "tpu", "neuron"
    peak_bf16_flops: float  # dense (no sparsity) bf16 FLOP/s per chip
    hbm_bytes: int  # per chip
    chips_per_host: int
    interconnect: str = ""
    source: str = ""


def with_device_spec(spec: DeviceSpec) -> Callable[[Callable], Callable]:
    """Decorator for a mesh-rule function: records the chip it targets."""

    def attach(fn: Callable) -> Callable:
        _SPECS[fn] = spec
        return fn

    return attach


def device_spec_of_rule(rule: Callable) -> DeviceSpec | None:
    """The chip a mesh-rule function was decorated with (`with_device_spec`), if any."""
    return _SPECS.get(rule)
