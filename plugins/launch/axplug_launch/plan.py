"""What a job template needs, resolved once from `axplug launch --print` arguments."""

from __future__ import annotations

import argparse
import dataclasses
import json
import shlex

from axplug_launch.agent import DEFAULT_MAX_RESTARTS, RESTART_EXIT_CODE

__all__ = [
    "JobPlan",
    "plan_job",
    "ArrayPlan",
    "plan_array",
    "ARRAY_TARGETS",
    "title",
    "shell_command",
    "yaml_string",
    "RESTART_EXIT_CODE",
]

DEFAULT_GRACE_S = 120  # a SIGTERMed trainer's time to finish its step and save it
ARRAY_TARGETS = ("slurm-array", "k8s-indexed")  # `prepare-data` in N independent tasks
DEFAULT_CPUS_PER_TASK = 16
DEFAULT_ARRAY_NAME = "axplug-prepare-data"
# prepare-data flags the array job sets itself, one per task.
_TASK_FLAGS = ("--num-tasks", "--task-index")


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
    from axplug.api.config import UsageError, resolve_preset
    from axplug.api.sharding import device_spec_of, resolve_rule, selector_device_count

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


@dataclasses.dataclass(frozen=True)
class ArrayPlan:
    """`axplug prepare-data` split over `tasks` independent tasks of one array job."""

    target: str
    name: str
    tasks: int
    max_parallel: int | None  # tasks running at once (None: as many as the cluster allows)
    cpus_per_task: int
    image: str
    output: str  # prepare-data's --output: shared by every task, and what --merge finalizes
    prepare_args: tuple[str, ...]  # `axplug prepare-data ...`, without the per-task flags

    @property
    def merge_args(self) -> tuple[str, ...]:
        """The fallback that writes meta.json when no task did."""
        return ("axplug", "prepare-data", "--merge", "--output", self.output)


def plan_array(args: argparse.Namespace) -> ArrayPlan:
    """Checks `--tasks` and the prepare-data words after them; UsageError names the fix."""
    from axplug.api.config import UsageError

    target = f"launch --print {args.target}"
    words = list(args.command)
    if words[:1] == ["--"]:
        words = words[1:]
    if words[:1] == ["axplug"]:
        words = words[1:]
    if words[:1] != ["prepare-data"]:
        given = f"got {shlex.join(words[:2])!r}" if words else "got nothing"
        raise UsageError(
            f"{target}: end with the command to split, e.g. `--tasks 8 prepare-data SOURCES "
            f"--tokenizer T --output OUT` ({given})"
        )
    if args.tasks is None or args.tasks < 1:
        hint = " (launch's flags go before prepare-data)" if "--tasks" in words else ""
        got = "" if args.tasks is None else f", got {args.tasks}"
        raise UsageError(f"{target} needs --tasks N (>= 1){hint}{got}")
    for flag, value in (
        ("--max-parallel", args.max_parallel),
        ("--cpus-per-task", args.cpus_per_task),
    ):
        if value is not None and value < 1:
            raise UsageError(f"{target}: {flag} must be >= 1, got {value}")
    for word in words:
        flag = word.split("=", 1)[0]
        if flag in _TASK_FLAGS:
            raise UsageError(
                f"{target}: drop {flag} from the prepare-data arguments; every task gets "
                f"--num-tasks {args.tasks} and its own --task-index"
            )
        if flag == "--merge":
            raise UsageError(
                f"{target}: drop --merge; the tasks write meta.json themselves (by hand, "
                "run `axplug prepare-data --merge --output OUT` on its own)"
            )
    output = _flag_value(words, "--output")
    if output is None:
        raise UsageError(f"{target}: prepare-data needs --output DIR (a shared path or URL)")
    workers = _flag_value(words, "--workers")
    cpus = args.cpus_per_task
    if cpus is None:  # the --workers given, or the default
        cpus = int(workers) if workers and workers.isdigit() else DEFAULT_CPUS_PER_TASK
    prepare = ["axplug", *words]
    if workers is None:
        prepare += ["--workers", str(cpus)]  # one tokenizing process per CPU of the task
    return ArrayPlan(
        target=args.target,
        name=args.name or DEFAULT_ARRAY_NAME,
        tasks=args.tasks,
        max_parallel=args.max_parallel,
        cpus_per_task=cpus,
        image=args.image,
        output=output,
        prepare_args=tuple(prepare),
    )


def _flag_value(words: list[str], flag: str) -> str | None:
    """The value of the last `flag VALUE` or `flag=VALUE` in `words`, or None."""
    value = None
    for i, word in enumerate(words):
        if word == flag and i + 1 < len(words):
            value = words[i + 1]
        elif word.startswith(flag + "="):
            value = word[len(flag) + 1 :]
    return value


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
