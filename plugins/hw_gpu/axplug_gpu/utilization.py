"""How busy the local NVIDIA GPUs are, from NVML (the `nvidia-ml-py` bindings), for the watchdog."""

from __future__ import annotations

import functools
import logging
import os

from axplug.api import hookimpl

__all__ = ["device_utilization", "nvml_indices"]

log = logging.getLogger("axplug_gpu")


def nvml_indices(devices: list, visible: str | None) -> list[int]:
    """NVML's index of each JAX GPU device: CUDA_VISIBLE_DEVICES (`visible`) renumbers them."""
    order = [int(x) for x in visible.split(",")] if visible else None
    out = []
    for device in devices:
        local = getattr(device, "local_hardware_id", None)
        local = device.id if local is None else local
        out.append(order[local] if order and local < len(order) else local)
    return out


@functools.cache
def _nvml():
    """The initialised pynvml module, or None (not installed, no driver)."""
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception as exc:  # noqa: BLE001 - ImportError, or NVMLError without a driver
        log.info("NVML unavailable (%s: %s): no GPU utilisation readings", type(exc).__name__, exc)
        return None
    return pynvml


@hookimpl
def device_utilization(devices: list) -> float | None:
    """Mean NVML `utilization.gpu` percentage of `devices`; None unless they are NVIDIA GPUs."""
    if not devices or any(d.platform != "gpu" for d in devices):
        return None
    nvml = _nvml()
    if nvml is None:
        return None
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "")
    if visible and not all(x.strip().isdigit() for x in visible.split(",")):
        visible = ""  # UUIDs or MIG names: fall back to JAX's own numbering
    busy = []
    for index in nvml_indices(devices, visible or None):
        handle = nvml.nvmlDeviceGetHandleByIndex(index)
        busy.append(float(nvml.nvmlDeviceGetUtilizationRates(handle).gpu))
    return sum(busy) / len(busy)
