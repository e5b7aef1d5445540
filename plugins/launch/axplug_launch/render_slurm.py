"""`axplug launch --print slurm`: an sbatch script with spare nodes, requeue and the agent;
`--print slurm-array`: `axplug prepare-data` as a job array, one slice of the sources a task."""

from __future__ import annotations

import shlex

from axplug_launch.plan import RESTART_EXIT_CODE, ArrayPlan, JobPlan, shell_command, title

__all__ = ["render_slurm", "render_slurm_array"]

SLURM_MAX_ARRAY_SIZE = 1001  # Slurm's default MaxArraySize: indices 0..1000


def render_slurm(plan: JobPlan) -> str:
    """The sbatch script: N training nodes out of N + spares, each task the agent."""
    gres = f"#SBATCH --gpus-per-node={plan.devices_per_host}\n" if plan.platform == "gpu" else ""
    device_ids = ",".join(str(i) for i in range(plan.devices_per_host))
    agent = " ".join(shlex.quote(a) for a in plan.agent_args[: -len(plan.train_args)])
    command = shell_command(plan.train_args, "      ")
    nodes = plan.hosts + plan.spares
    max_attempts = plan.spares + 3
    return f"""#!/bin/bash
{title(plan)}
#SBATCH --job-name={plan.name}
#SBATCH --nodes={nodes}
#SBATCH --ntasks-per-node=1
{gres}#SBATCH --exclusive
#SBATCH --no-kill
#SBATCH --requeue
#SBATCH --signal=B:TERM@{plan.grace_s}
#SBATCH --open-mode=append
#SBATCH --output={plan.name}-%j.log

# {plan.hosts} of the {nodes} nodes train, one process per node owning all its devices; the
# others stand by (--no-kill: a failed node does not end the allocation). `axplug train` sees
# the Slurm step and calls jax.distributed.initialize, which reads SLURM_STEP_NODELIST
# (coordinator: the first node), SLURM_NTASKS (process count) and SLURM_PROCID (this process).
# On every node the agent restarts a trainer that exits {RESTART_EXIT_CODE} (hung, lost peer)
# in place.
export JAX_COORDINATOR_PORT={plan.port}
export JAX_LOCAL_DEVICE_IDS={device_ids}
TRAIN_NODES={plan.hosts}
MAX_ATTEMPTS={max_attempts}

# --signal=B:TERM@{plan.grace_s}: on preemption or {plan.grace_s} s before the time limit this
# shell gets SIGTERM and passes it on; every trainer saves its step and exits
# {RESTART_EXIT_CODE}; the job requeues.
trap 'preempted=1; kill -TERM "$step" 2>/dev/null' TERM
for attempt in $(seq "$MAX_ATTEMPTS"); do
  # Nodes of the allocation that Slurm reports failed: a standby node takes their place.
  down=$(sinfo --noheader --Node --nodes="$SLURM_JOB_NODELIST" --states=down,drain,fail \\
    --format=%N | sort -u | paste -sd, -)
  srun --nodes="$TRAIN_NODES" --ntasks="$TRAIN_NODES" --kill-on-bad-exit=1 \\
    ${{down:+--exclude="$down"}} \\
    {agent} \\
    {command} &
  step=$!
  code=0; wait "$step" || code=$?
  if [ -n "${{preempted:-}}" ]; then
    wait "$step"; code=$?
    scontrol requeue "$SLURM_JOB_ID"; exit "$code"
  fi
  # 0: trained to max_steps; 2: bad flags or config, which a rerun repeats.
  if [ "$code" -eq 0 ] || [ "$code" -eq 2 ]; then exit "$code"; fi
  echo "axplug: attempt $attempt ended with $code; restarting on the healthy nodes" >&2
done
exit "$code"
"""


def render_slurm_array(plan: ArrayPlan) -> str:
    """The sbatch script: task i of the array runs `axplug prepare-data --task-index i`."""
    throttle = f"%{plan.max_parallel}" if plan.max_parallel else ""
    at_once = f", at most {plan.max_parallel} at a time" if plan.max_parallel else ""
    big = (
        f"# {plan.tasks} tasks: more than Slurm's default MaxArraySize ({SLURM_MAX_ARRAY_SIZE}) "
        "allows; see `scontrol show config | grep MaxArraySize`.\n"
        if plan.tasks > SLURM_MAX_ARRAY_SIZE
        else ""
    )
    command = shell_command((*plan.prepare_args, "--num-tasks", str(plan.tasks)), "    ")
    merge = shlex.quote(shlex.join(plan.merge_args))
    return f"""#!/bin/bash
# axplug: prepare-data in {plan.tasks} array tasks{at_once}, {plan.cpus_per_task} CPUs each
# Task i tokenizes the i-th slice of the sources into the output every task shares (a shared
# filesystem or an object-store URL); the last task to finish writes meta.json.
#SBATCH --job-name={plan.name}
#SBATCH --array=0-{plan.tasks - 1}{throttle}
#SBATCH --ntasks=1
#SBATCH --cpus-per-task={plan.cpus_per_task}
#SBATCH --requeue
#SBATCH --open-mode=append
#SBATCH --output={plan.name}-%A_%a.log
{big}# Add --partition, --account, --time or --mem lines for your cluster.

# --requeue: a task preempted or on a failed node runs again, as does one resubmitted by hand
# (sbatch --array=3 THIS_SCRIPT); prepare-data skips the shards it finished, so it resumes.
# Object stores: a task sees the environment sbatch was called in (AWS_ENDPOINT_URL,
# AWS_REGION, credentials, ...); export them here to pin them.
set -euo pipefail
: "${{SLURM_ARRAY_TASK_ID:?submit this script with sbatch: the array sets it}}"
exec {command} \\
    --task-index "$SLURM_ARRAY_TASK_ID"

# Fallback: if no task wrote meta.json (say a task was rerun by hand after the others ended),
# write it once every task has succeeded:
#   JOBID=$(sbatch --parsable THIS_SCRIPT)
#   sbatch --dependency=afterok:$JOBID --job-name={plan.name}-merge \\
#       --output={plan.name}-merge-%j.log --wrap={merge}
"""
