"""`axplug launch --print slurm|k8s|tpu-vm`: a job template that runs `axplug train` on every host.

axplug schedules nothing itself: these are starting points for Slurm, Kubernetes and Cloud TPU
VMs, filled in for one preset and mesh rule. Every host runs the same `axplug train` command;
the template supplies what `jax.distributed` needs (see docs/launch.md).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shlex
import sys
from typing import Any

__all__ = ["add_parser", "run", "JobPlan", "plan_job", "render", "TARGETS"]

TARGETS = ("slurm", "k8s", "tpu-vm")
DEFAULT_PORT = 1234
HANG_EXIT_CODE = 75  # axplug.runtime.HANG_EXIT_CODE, repeated so this module imports no jax

# Kubernetes resource names of one accelerator, by DeviceSpec platform.
_K8S_RESOURCES = {
    "gpu": "nvidia.com/gpu",
    "tpu": "google.com/tpu",
    "neuron": "aws.amazon.com/neuron",
}

EPILOG = """\
examples:
  axplug launch --print slurm --preset llama2-7b --mesh-rule gpu-h100-8x4 > job.sbatch
  axplug launch --print k8s --preset llama2-7b --mesh-rule gpu-h100-8x4 \\
      --image ghcr.io/me/axplug:1 --output-dir gs://bucket/runs/l7b > job.yaml
  axplug launch --print tpu-vm --preset llama2-7b --mesh-rule tpu-v5e-256 > run_on_tpu.sh

The host count is the mesh rule selector's device count (gpu-h100-8x4: 32) divided by the
chips per host of the rule's device spec; --hosts and --devices-per-host override both.
Every template sets watchdog.exit_on_hang=True: a hung job exits with code 75 and its rerun
resumes from the last checkpoint in --output-dir, which every host must share.
"""


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "launch",
        help="print a Slurm, Kubernetes or Cloud TPU VM template that runs `axplug train`",
        description="Print a job template running the same `axplug train` command on every "
        "host of a cluster, for a preset and a mesh rule. axplug is not a scheduler: the "
        "template is for the one you have.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--print", required=True, choices=TARGETS, dest="target")
    parser.add_argument("--preset", required=True, help="preset name")
    parser.add_argument(
        "--mesh-rule",
        required=True,
        metavar="NAME|SELECTOR",
        help="mesh rule for every host, e.g. gpu-h100-8x4 (4 hosts of 8 H100)",
    )
    parser.add_argument("--hosts", type=int, help="hosts (processes) in the job")
    parser.add_argument("--devices-per-host", type=int, help="accelerators per host")
    parser.add_argument("--name", help="job name (default: axplug-PRESET)")
    parser.add_argument("--output-dir", help="run directory shared by all hosts (a URL or path)")
    parser.add_argument("--image", default="REGISTRY/axplug:latest", help="container (k8s)")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT, help="coordinator port")
    parser.add_argument(
        "--modifier", action="append", default=[], metavar="NAME[:k=v,...]", help="repeatable"
    )
    parser.add_argument(
        "--set", action="append", default=[], dest="overrides", metavar="PATH=VALUE"
    )
    parser.set_defaults(run=run)
    return parser


@dataclasses.dataclass(frozen=True)
class JobPlan:
    """Everything a template needs, resolved from the arguments."""

    target: str
    name: str
    preset: str
    mesh_rule: str  # the selector as given: every host passes it to `axplug train`
    rule_name: str
    description: str
    platform: str  # gpu, tpu, neuron, cpu
    hosts: int
    devices_per_host: int
    output_dir: str
    image: str
    port: int
    train_args: tuple[str, ...]


def plan_job(args: argparse.Namespace) -> JobPlan:
    """Resolves preset, mesh rule and host count; UsageError names what is wrong and the fix."""
    from axplug.config import UsageError
    from axplug.mesh_rules import device_spec_of, resolve_rule, selector_device_count
    from axplug.presets import resolve_preset

    try:
        resolve_preset(args.preset)
    except LookupError as exc:
        raise UsageError(f"--preset: {exc}") from None
    rule_name, rule = resolve_rule(args.mesh_rule)
    spec = device_spec_of(rule_name)
    per_host = args.devices_per_host or (spec.chips_per_host if spec else None)
    if per_host is None:
        raise UsageError(f"mesh rule {rule_name!r} names no device spec; pass --devices-per-host")
    hosts = args.hosts
    if hosts is None:
        total = selector_device_count(args.mesh_rule)
        if total is None or total % per_host:
            raise UsageError(
                f"cannot tell the host count from --mesh-rule {args.mesh_rule!r} "
                f"({total or 'no'} devices, {per_host} per host); pass --hosts, or a selector "
                "ending in the device count such as gpu-h100-8x4"
            )
        hosts = total // per_host
    if hosts < 1 or per_host < 1:
        raise UsageError(f"need at least one host and device, got {hosts} x {per_host}")
    name = args.name or f"axplug-{args.preset}"
    output_dir = args.output_dir or (
        f"/shared/axplug/runs/{name}"
        if args.target == "slurm"
        else f"gs://BUCKET/axplug/runs/{name}"
    )
    train_args = ["axplug", "train", "--preset", args.preset, "--mesh-rule", args.mesh_rule]
    train_args += ["--output-dir", output_dir]
    for spec_text in args.modifier:
        train_args += ["--modifier", spec_text]
    for override in args.overrides:
        train_args += ["--set", override]
    train_args += ["--set", "watchdog.exit_on_hang=True"]
    if args.target == "tpu-vm":
        train_args += ["--cluster", "tpu-vm"]
    return JobPlan(
        target=args.target,
        name=name,
        preset=args.preset,
        mesh_rule=args.mesh_rule,
        rule_name=rule_name,
        description=rule.config.description,
        platform=spec.platform if spec else "cpu",
        hosts=hosts,
        devices_per_host=per_host,
        output_dir=output_dir,
        image=args.image,
        port=args.port,
        train_args=tuple(train_args),
    )


def _title(plan: JobPlan) -> str:
    rule = f"# mesh rule {plan.rule_name}" + (f": {plan.description}" if plan.description else "")
    return (
        f"# axplug: preset {plan.preset} on {plan.hosts} hosts x {plan.devices_per_host} "
        f"{plan.platform} devices\n{rule}"
    )


def _shell_command(args: tuple[str, ...], indent: str) -> str:
    words = [shlex.quote(a) for a in args]
    lines, line = [], words[0]
    for word in words[1:]:
        if word.startswith("--") and len(line) > len(indent):
            lines.append(line)
            line = indent + word
        else:
            line += " " + word
    lines.append(line)
    return " \\\n".join(lines)


def render_slurm(plan: JobPlan) -> str:
    gres = f"#SBATCH --gpus-per-node={plan.devices_per_host}\n" if plan.platform == "gpu" else ""
    device_ids = ",".join(str(i) for i in range(plan.devices_per_host))
    command = _shell_command(plan.train_args, "    ")
    return f"""#!/bin/bash
{_title(plan)}
#SBATCH --job-name={plan.name}
#SBATCH --nodes={plan.hosts}
#SBATCH --ntasks-per-node=1
{gres}#SBATCH --exclusive
#SBATCH --requeue
#SBATCH --open-mode=append
#SBATCH --output={plan.name}-%j.log

# One process per node owning all its devices. `axplug train` sees the Slurm job and calls
# jax.distributed.initialize, which reads SLURM_STEP_NODELIST (coordinator: the first node),
# SLURM_NTASKS (process count) and SLURM_PROCID (this process).
export JAX_COORDINATOR_PORT={plan.port}
export JAX_LOCAL_DEVICE_IDS={device_ids}

srun --kill-on-bad-exit=1 \\
  {command} || code=$?
# Exit code {HANG_EXIT_CODE}: the watchdog stopped a hung run. Requeued, it resumes from the last
# checkpoint in the output dir.
if [ "${{code:-0}}" -eq {HANG_EXIT_CODE} ]; then scontrol requeue "$SLURM_JOB_ID"; fi
exit "${{code:-0}}"
"""


def _yaml(value: str) -> str:
    return json.dumps(value)  # a JSON string is a valid YAML scalar, quoted and escaped


def render_k8s(plan: JobPlan) -> str:
    resource = _K8S_RESOURCES.get(plan.platform)
    limits = (
        f"""
          resources:
            limits:
              {resource}: {plan.devices_per_host}"""
        if resource
        else ""
    )
    command = "\n".join(f"            - {_yaml(a)}" for a in plan.train_args)
    return f"""{_title(plan)}
# A headless Service gives pod i the name {plan.name}-i.{plan.name}; pod 0 is the coordinator.
# The Job is Indexed: each pod's completion index is its JAX process id.
apiVersion: v1
kind: Service
metadata:
  name: {plan.name}
spec:
  clusterIP: None
  selector:
    job-name: {plan.name}
---
apiVersion: batch/v1
kind: Job
metadata:
  name: {plan.name}
spec:
  completionMode: Indexed
  completions: {plan.hosts}
  parallelism: {plan.hosts}
  # A failed pod (e.g. exit {HANG_EXIT_CODE} from the watchdog) is retried and resumes from the
  # last checkpoint in the output dir.
  backoffLimit: {max(3, plan.hosts)}
  template:
    spec:
      subdomain: {plan.name}
      restartPolicy: Never
      containers:
        - name: train
          image: {_yaml(plan.image)}
          command:
{command}
          env:
            - name: JAX_COORDINATOR_ADDRESS
              value: {_yaml(f"{plan.name}-0.{plan.name}:{plan.port}")}
            - name: JAX_NUM_PROCESSES
              value: {_yaml(str(plan.hosts))}
            - name: JAX_PROCESS_ID
              valueFrom:
                fieldRef:
                  fieldPath: metadata.annotations['batch.kubernetes.io/job-completion-index']
          ports:
            - containerPort: {plan.port}{limits}
"""


def render_tpu_vm(plan: JobPlan) -> str:
    command = shlex.quote(" ".join(shlex.quote(a) for a in plan.train_args))
    return f"""#!/bin/bash
{_title(plan)}
# Runs the same command on all {plan.hosts} workers of a TPU VM slice. With --cluster tpu-vm,
# jax.distributed.initialize reads the workers and this worker's id from the TPU metadata
# server. Install axplug and its plugins (axplug-tpu, ...) on every worker first.
set -euo pipefail
TPU_NAME="${{TPU_NAME:-{plan.name}}}"
ZONE="${{ZONE:?set ZONE to the zone of the TPU VM}}"

gcloud compute tpus tpu-vm ssh "$TPU_NAME" --zone "$ZONE" --worker=all --command {command}
"""


_RENDERERS = {"slurm": render_slurm, "k8s": render_k8s, "tpu-vm": render_tpu_vm}


def render(plan: JobPlan) -> str:
    """The template text for `plan.target`."""
    return _RENDERERS[plan.target](plan)


def run(args: argparse.Namespace) -> int:
    sys.stdout.write(render(plan_job(args)))
    return 0
