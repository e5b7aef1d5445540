"""axplug-tpu's device_utilization hook: the TPU runtime's duty cycle, averaged."""

from __future__ import annotations

import dataclasses

import pytest

pytest.importorskip("axplug_tpu")


@dataclasses.dataclass(frozen=True)
class _Device:
    id: int
    platform: str
    local_hardware_id: int | None = None


def test_tpu_utilization_averages_the_runtimes_duty_cycle(monkeypatch):
    import sys
    import types

    from axplug_tpu import utilization

    tpus = [_Device(0, "tpu"), _Device(1, "tpu")]
    monkeypatch.setitem(sys.modules, "libtpu.sdk", None)  # libtpu absent: no reading
    assert utilization.device_utilization(tpus) is None
    metric = types.SimpleNamespace(data=lambda: ["45.5", "54.5", "60.0", "40.0"])
    sdk = types.SimpleNamespace(
        tpumonitoring=types.SimpleNamespace(get_metric={"duty_cycle_pct": metric}.__getitem__)
    )
    monkeypatch.setitem(sys.modules, "libtpu", types.SimpleNamespace(sdk=sdk))
    monkeypatch.setitem(sys.modules, "libtpu.sdk", sdk)
    assert utilization.device_utilization(tpus) == pytest.approx(50.0)
    assert utilization.device_utilization([_Device(0, "gpu", 0)]) is None
