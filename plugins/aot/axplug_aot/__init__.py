"""axplug-aot: `axplug aot`, a train step compiled for a mesh rule's topology without running it.

It builds on the core's public faces alone: the mesh rule and its `DeviceSpec`
(`axplug.mesh_rules`), the Trainer's `lower_step` and FLOP model (`axplug.trainer`).
"""

from axplug_aot.report import AotReport, check_batch, compile_report, count_collectives, scale_down

__version__ = "0.1.0"

__all__ = ["AotReport", "check_batch", "compile_report", "count_collectives", "scale_down"]
