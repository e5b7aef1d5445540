"""axplug-gpu's device_utilization hook: NVML read for JAX's devices (CUDA_VISIBLE_DEVICES
mapped), and no answer without a driver."""

from __future__ import annotations

import dataclasses

import pytest

pytest.importorskip("axplug_gpu")


@dataclasses.dataclass(frozen=True)
class _Device:
    id: int
    platform: str
    local_hardware_id: int | None = None


class _FakeNvml:
    """pynvml's calls the GPU plugin makes, over fixed per-index busy percentages."""

    def __init__(self, busy):
        self.busy = busy

    def nvmlInit(self):
        pass

    def nvmlDeviceGetHandleByIndex(self, index):
        return index

    def nvmlDeviceGetUtilizationRates(self, handle):
        return type("Rates", (), {"gpu": self.busy[handle]})()


def test_gpu_utilization_reads_nvml_for_the_jax_devices(monkeypatch):
    import sys

    from axplug_gpu import utilization

    monkeypatch.setitem(sys.modules, "pynvml", _FakeNvml([10, 20, 30, 90]))
    utilization._nvml.cache_clear()
    gpus = [_Device(0, "gpu", local_hardware_id=0), _Device(1, "gpu", local_hardware_id=3)]
    try:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
        assert utilization.device_utilization(gpus) == (10 + 90) / 2
        # CUDA_VISIBLE_DEVICES=2,0,3,1: JAX's GPU 0 is NVML's 2, its GPU 3 is NVML's 1.
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,0,3,1")
        assert utilization.device_utilization(gpus) == (30 + 20) / 2
        assert utilization.device_utilization([_Device(0, "cpu")]) is None  # not GPUs
    finally:
        utilization._nvml.cache_clear()


def test_gpu_utilization_is_none_without_a_driver(monkeypatch):
    import sys

    from axplug_gpu import utilization

    class NoDriver(_FakeNvml):
        def nvmlInit(self):
            raise OSError("NVML Shared Library Not Found")

    monkeypatch.setitem(sys.modules, "pynvml", NoDriver([]))
    utilization._nvml.cache_clear()
    try:
        assert utilization.device_utilization([_Device(0, "gpu", 0)]) is None
    finally:
        utilization._nvml.cache_clear()
