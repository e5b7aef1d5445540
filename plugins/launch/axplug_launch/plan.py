"""What a job template needs, resolved once from `axplug launch --print` arguments."""

from __future__ import annotations

import argparse
import dataclasses
import json
import shlex

from axplug_launch.agent import DEFAULT_MAX_RESTARTS, RESTART_EXIT_CODE

__all__ = ["JobPlan", "plan_job", "title", "shell_command", "yaml_string", "RESTART_EXIT_CODE"]

DEFAULT_GRACE_S = 120  # a SIGTERMed trainer's time to finish its step and save it


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
    spares: int = 0  # standby hosts (nodes) beside `hosts`
    spare_command: tuple[str, ...] = ()  # low-priority work on a standby host
    grace_s: int = DEFAULT_GRACE_S
    max_restarts: int = DEFAULT_MAX_RESTARTS  # the agent's in-place restarts

    @property
    def agent_args(self) -> tuple[str, ...]:
        """What every host runs: the agent around `axplug train`."""
        agent = ("axplug", "launch", "--agent", "--max-restarts", str(self.max_restarts), "--")
        return agent + self.train_args


def plan_job(args: argparse.Namespace) -> JobPlan:
    """Resolves preset, mesh rule and host count; UsageError names what is wrong and the fix."""
    from axplug.config import UsageError
    from axplug.mesh_rules import device_spec_of, resolve_rule, selector_device_count
    from axplug.presets import resolve_preset

    for flag, value in (("--preset", args.preset), ("--mesh-rule", args.mesh_rule)):
        if value is None:
            raise UsageError(f"launch --print needs {flag}")
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
    if args.spares < 0:
        raise UsageError(f"--spares: must be >= 0, got {args.spares}")
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
        spares=args.spares,
        spare_command=tuple(shlex.split(args.spare_command or "")),
        max_restarts=DEFAULT_MAX_RESTARTS if args.max_restarts is None else args.max_restarts,
    )


def title(plan: JobPlan) -> str:
    """The two comment lines every template starts with."""
    rule = f"# mesh rule {plan.rule_name}" + (f": {plan.description}" if plan.description else "")
    spares = f" (+{plan.spares} standby)" if plan.spares else ""
    return (
        f"# axplug: preset {plan.preset} on {plan.hosts} hosts{spares} x "
        f"{plan.devices_per_host} {plan.platform} devices\n{rule}"
    )


def shell_command(args: tuple[str, ...], indent: str) -> str:
    """`args` as a shell command, one `--flag value` per continued line."""
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


def yaml_string(value: str) -> str:
    """A JSON string: a valid YAML scalar, quoted and escaped."""
    return json.dumps(value)
