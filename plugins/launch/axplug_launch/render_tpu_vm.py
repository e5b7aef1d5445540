"""`axplug launch --print tpu-vm`: the same command on every worker of a TPU VM slice."""

from __future__ import annotations

import shlex

from axplug_launch.plan import JobPlan, title

__all__ = ["render_tpu_vm"]


def render_tpu_vm(plan: JobPlan) -> str:
    """A gcloud ssh --worker=all script running the agent around `axplug train`."""
    command = shlex.quote(" ".join(shlex.quote(a) for a in plan.agent_args))
    return f"""#!/bin/bash
{title(plan)}
# Runs the same command on all {plan.hosts} workers of a TPU VM slice. With --cluster tpu-vm,
# jax.distributed.initialize reads the workers and this worker's id from the TPU metadata
# server. Install axplug and its plugins (axplug-tpu, ...) on every worker first.
set -euo pipefail
TPU_NAME="${{TPU_NAME:-{plan.name}}}"
ZONE="${{ZONE:?set ZONE to the zone of the TPU VM}}"

gcloud compute tpus tpu-vm ssh "$TPU_NAME" --zone "$ZONE" --worker=all --command {command}
"""
