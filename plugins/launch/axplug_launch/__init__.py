"""Job renderers for axplug: `axplug launch --print slurm|k8s|tpu-vm`."""

from axplug_launch.command import TARGETS, JobPlan, plan_job, render

__all__ = ["TARGETS", "JobPlan", "plan_job", "render"]
