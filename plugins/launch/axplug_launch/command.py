"""`axplug launch`: job templates (`--print slurm|k8s|tpu-vm`), a local job with standby hosts
(`--local`), the agent every host runs around `axplug train` (`--agent`), and array jobs that
split `axplug prepare-data` into independent tasks (`--print slurm-array|k8s-indexed`).

axplug schedules nothing on a cluster: the templates are starting points for Slurm,
Kubernetes and Cloud TPU VMs, filled in for one preset and mesh rule. Every host runs the same
`axplug train` command inside the agent; the template supplies what `jax.distributed` needs,
standby capacity and the retry rules (see docs/launch.md).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import Any

from axplug.api import add_command, add_config_arguments
from axplug_launch.agent import DEFAULT_MAX_RESTARTS
from axplug_launch.plan import (
    ARRAY_TARGETS,
    DEFAULT_ARRAY_NAME,
    DEFAULT_CPUS_PER_TASK,
    DEFAULT_GRACE_S,
    plan_array,
    plan_job,
)
from axplug_launch.render_k8s import render_k8s, render_k8s_indexed
from axplug_launch.render_slurm import render_slurm, render_slurm_array
from axplug_launch.render_tpu_vm import render_tpu_vm

__all__ = ["add_parser", "run", "render", "TARGETS"]

TARGETS = ("slurm", "k8s", "tpu-vm", *ARRAY_TARGETS)
DEFAULT_PORT = 1234
LOCAL_MAX_RESTARTS = 10  # a local job's swaps and in-place restarts together
_RENDERERS: dict[str, Callable[[Any], str]] = {
    "slurm": render_slurm,
    "k8s": render_k8s,
    "tpu-vm": render_tpu_vm,
    "slurm-array": render_slurm_array,
    "k8s-indexed": render_k8s_indexed,
}

EPILOG = """\
examples:
  axplug launch --print slurm --preset llama2-7b --mesh-rule gpu-h100-8x4 --spares 1 > job.sbatch
  axplug launch --print k8s --preset llama2-7b --mesh-rule gpu-h100-8x4 --spares 1 \\
      --image ghcr.io/me/axplug:1 --output-dir gs://bucket/runs/l7b > job.yaml
  axplug launch --print tpu-vm --preset llama2-7b --mesh-rule tpu-v5e-256 > run_on_tpu.sh
  axplug launch --local --num-processes 2 --spares 1 --devices-per-host 4 -- \\
      axplug train --preset llama-tiny --modifier mesh:fsdp=-1 --output-dir runs/swap
  axplug launch --agent -- axplug train --preset llama-tiny --output-dir runs/tiny
  axplug launch --print slurm-array --tasks 64 --max-parallel 16 prepare-data \\
      /shared/raw/*.jsonl --tokenizer tokenizer.json --output /shared/data/web > prep.sbatch
  axplug launch --print k8s-indexed --tasks 64 --max-parallel 16 --image ghcr.io/me/axplug:1 \\
      prepare-data /data/raw/part-{00..63}.jsonl --tokenizer /data/tokenizer.json \\
      --output s3://bucket/data/web > prep.yaml

The host count is the mesh rule selector's device count (gpu-h100-8x4: 32) divided by the
chips per host of the rule's device spec; --hosts and --devices-per-host override both.
Every training template runs the agent (restarts in place on exit 75) and sets
watchdog.exit_on_hang=True; a rerun resumes from the last checkpoint in --output-dir, which
every host must share.

slurm-array and k8s-indexed run `axplug prepare-data` (everything after the word
prepare-data, passed on as given) in --tasks N independent tasks: task i adds --num-tasks N
--task-index i ($SLURM_ARRAY_TASK_ID, $(JOB_COMPLETION_INDEX)) and --workers C unless given,
and tokenizes its slice of the sources into the shared --output; the last task to finish
writes meta.json. Sources and tokenizer are paths every task sees (in a pod: a volume you
mount). A failed task retries alone and resumes; `axplug prepare-data --merge
--output OUT` writes meta.json by hand (the sbatch script shows the dependent merge job).
"""


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    parser = add_command(
        subparsers,
        "launch",
        run,
        help="print a Slurm, Kubernetes or Cloud TPU VM template (training, or prepare-data in "
        "array tasks), run a local job with standby hosts, or run the restart agent",
        description="Print a job template running the same `axplug train` command on every "
        "host of a cluster (--print), run that arrangement on this machine with standby "
        "hosts (--local), or run the agent that restarts a trainer in place (--agent). "
        "--print slurm-array|k8s-indexed splits `axplug prepare-data` into array tasks. "
        "axplug is not a scheduler: the template is for the one you have.",
        epilog=EPILOG,
    )
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--print", choices=TARGETS, dest="target", help="print a job template")
    mode.add_argument(
        "--local", action="store_true", help="run N trainers and S standby hosts here"
    )
    mode.add_argument(
        "--agent", action="store_true", help="run COMMAND, restarting it in place on exit 75"
    )
    parser.add_argument("--preset", help="preset name (--print)")
    parser.add_argument(
        "--mesh-rule",
        metavar="NAME|SELECTOR",
        help="mesh rule for every host, e.g. gpu-h100-8x4 (4 hosts of 8 H100) (--print)",
    )
    parser.add_argument(
        "--hosts", "--num-processes", type=int, dest="hosts", help="hosts (processes) that train"
    )
    parser.add_argument("--devices-per-host", type=int, help="accelerators per host")
    parser.add_argument(
        "--spares", type=int, default=0, help="standby hosts beside them (default: 0)"
    )
    parser.add_argument(
        "--spare-command",
        metavar="COMMAND",
        help="low-priority work on each standby host, stopped with SIGTERM when the host is "
        "taken; {host} and {host_dir} are replaced (--local)",
    )
    parser.add_argument(
        "--max-restarts",
        type=int,
        help=f"restarts before giving up (default: {DEFAULT_MAX_RESTARTS}; --local: "
        f"{LOCAL_MAX_RESTARTS})",
    )
    group = parser.add_argument_group("--print")
    group.add_argument(
        "--name",
        "--job-name",
        dest="name",
        help=f"job name (default: axplug-PRESET; arrays: {DEFAULT_ARRAY_NAME})",
    )
    group.add_argument("--output-dir", help="run directory shared by all hosts (a URL or path)")
    group.add_argument(
        "--image", default="REGISTRY/axplug:latest", help="container (k8s, k8s-indexed)"
    )
    group.add_argument("--port", type=int, default=DEFAULT_PORT, help="coordinator port")
    add_config_arguments(group)
    group = parser.add_argument_group(
        "--print slurm-array|k8s-indexed (then: prepare-data ARGS...)"
    )
    group.add_argument("--tasks", type=int, metavar="N", help="array tasks (indices 0..N-1)")
    group.add_argument(
        "--max-parallel",
        type=int,
        metavar="K",
        help="tasks running at once (Slurm: --array=0-(N-1)%%K; k8s: parallelism; default: all)",
    )
    group.add_argument(
        "--cpus-per-task",
        type=int,
        metavar="C",
        help=f"CPUs of each task, prepare-data's --workers unless given "
        f"(default: {DEFAULT_CPUS_PER_TASK})",
    )
    group = parser.add_argument_group("--local")
    group.add_argument(
        "--scratch-dir",
        default=".axplug-hosts",
        help="one directory per host under it, and hosts.json (default: .axplug-hosts)",
    )
    group.add_argument(
        "--elastic",
        action="store_true",
        help="with no standby left, continue on fewer processes (the global batch kept by "
        "gradient accumulation) and grow back when a host returns",
    )
    group.add_argument(
        "--regrow-after",
        type=float,
        metavar="SECONDS",
        help="a failed host is healthy again this long after it failed (default: never)",
    )
    group.add_argument(
        "--grace",
        type=float,
        default=DEFAULT_GRACE_S,
        help=f"seconds a SIGTERMed trainer gets to save (default: {DEFAULT_GRACE_S})",
    )
    group.add_argument(
        "--spare-grace",
        type=float,
        default=30.0,
        help="seconds a standby host's low-priority job gets to yield it (default: 30)",
    )
    parser.add_argument(
        "command",
        nargs=argparse.REMAINDER,
        help="after --: the command (--agent, --local); prepare-data and its arguments "
        "(--print slurm-array|k8s-indexed)",
    )
    return parser


def render(plan: Any) -> str:
    """The template text for `plan.target`."""
    return _RENDERERS[plan.target](plan)


def _command(args: argparse.Namespace) -> list[str]:
    from axplug.api.config import UsageError

    command = list(args.command)
    if command[:1] == ["--"]:
        command = command[1:]
    if not command:
        flag = "--agent" if args.agent else "--local"
        raise UsageError(f"launch {flag}: give the command after --, e.g. -- axplug train ...")
    return command


def _run_local(args: argparse.Namespace) -> int:
    import shlex

    from axplug.api.config import UsageError
    from axplug_launch.local import LocalJob, run_local

    command = _command(args)
    for flag in ("--coordinator", "--num-processes", "--process-id"):
        if flag in command:
            raise UsageError(
                f"launch --local: the trainer command sets {flag}; drop it, launch gives each "
                "process its own"
            )
    if not args.hosts or args.hosts < 1 or args.spares < 0:
        raise UsageError("launch --local needs --num-processes N (>= 1) and --spares S (>= 0)")
    job = LocalJob(
        command=tuple(command),
        processes=args.hosts,
        spares=args.spares,
        devices_per_host=args.devices_per_host or 1,
        scratch_dir=args.scratch_dir,
        spare_command=tuple(shlex.split(args.spare_command or "")),
        elastic=args.elastic,
        regrow_after_s=args.regrow_after,
        max_restarts=LOCAL_MAX_RESTARTS if args.max_restarts is None else args.max_restarts,
        grace_s=args.grace,
        spare_grace_s=args.spare_grace,
    )
    return run_local(job)


def run(args: argparse.Namespace) -> int:
    if args.agent:
        from axplug_launch.agent import run_agent

        budget = DEFAULT_MAX_RESTARTS if args.max_restarts is None else args.max_restarts
        return run_agent(_command(args), max_restarts=budget)
    if args.local:
        return _run_local(args)
    if args.target in ARRAY_TARGETS:
        sys.stdout.write(render(plan_array(args)))
        return 0
    from axplug.api.config import UsageError

    for flag, value in (
        ("--tasks", args.tasks),
        ("--max-parallel", args.max_parallel),
        ("--cpus-per-task", args.cpus_per_task),
    ):
        if value is not None:
            raise UsageError(f"{flag} is for --print slurm-array|k8s-indexed, not {args.target}")
    sys.stdout.write(render(plan_job(args)))
    return 0
