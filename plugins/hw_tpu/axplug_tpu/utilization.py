"""How busy the local TPU chips are, from the TPU runtime's duty cycle, for the watchdog."""

from __future__ import annotations

import logging

from axplug.api import hookimpl

__all__ = ["device_utilization"]

log = logging.getLogger("axplug_tpu")


def _monitoring():
    """libtpu's monitoring SDK, or None where libtpu (or its SDK) is not installed."""
    try:
        from libtpu.sdk import tpumonitoring
    except ImportError:
        return None
    return tpumonitoring


@hookimpl
def device_utilization(devices: list) -> float | None:
    """Mean `duty_cycle_pct` of this host's chips; None unless `devices` are TPUs."""
    if not devices or any(d.platform != "tpu" for d in devices):
        return None
    monitoring = _monitoring()
    if monitoring is None:
        return None
    # One percentage (as text) per chip on this host: the share of time the chip was busy.
    values = [float(x) for x in monitoring.get_metric("duty_cycle_pct").data()]
    return sum(values) / len(values) if values else None
