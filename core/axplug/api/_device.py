"""`DeviceSpec`: the chip a mesh rule targets, attached to the rule with `with_device_spec`."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

__all__ = ["DeviceSpec", "with_device_spec"]


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
    """Decorator for a mesh-rule function: records the chip it targets as `fn.device_spec`."""

    def attach(fn: Callable) -> Callable:
        fn.device_spec = spec  # type: ignore[attr-defined]  # a function attribute, by design
        return fn

    return attach
