"""axplug-launch: job templates, a local job with standby hosts, and the restart agent."""

from axplug_launch.agent import run_agent
from axplug_launch.command import TARGETS, render
from axplug_launch.local import LocalJob, run_local
from axplug_launch.plan import JobPlan, plan_job

__all__ = ["TARGETS", "JobPlan", "LocalJob", "plan_job", "render", "run_agent", "run_local"]
