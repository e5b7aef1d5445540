"""`axplug aot`: compile a preset's train step for a mesh rule's topology and report the plan."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
from typing import Any

from axplug.api import add_command, add_config_arguments

__all__ = ["add_parser", "run", "build_config", "format_report", "EXIT_OOM"]

EXIT_OOM = 3
_CHILD_ENV = "AXPLUG_AOT_CHILD"

EPILOG = """\
examples:
  axplug aot --preset llama-tiny --mesh-rule cpu --json
  axplug aot --preset gpt-tiny --mesh-rule gpu-h100-8 --modifier mesh:fsdp=4,data=-1
  axplug aot --preset llama2-70b --mesh-rule gpu-h100-8      would it fit on one H100 host?
  axplug aot --preset gpt-tiny --mesh-rule cpu --dump hlo/     and write its HLO to hlo/

The step is lowered and compiled from abstract shapes; nothing is allocated or run. A TPU rule
compiles for the real TPU topology (jax.experimental.topologies) where libtpu is installed.
Otherwise the step compiles on fake CPU devices (XLA_FLAGS=
--xla_force_host_platform_device_count=N; the command re-runs itself with it when jax already
started with fewer devices), with the rule's flash attention as the blockwise XLA kernel and
bfloat16 as float16 so that memory is the accelerator's; the report's notes say which. There,
a mesh larger than --max-devices is compiled with its `data` axis and the global batch divided
by the same factor: data replicas are identical, so per-device memory is unchanged, and FLOPs
are scaled back.
Exit status 3 when the step would not fit in the device's HBM.
--dump DIR writes the compiled step's HLO (before and after XLA's optimizations) and its
memory and cost analysis there, e.g. to read which layer's ops a fusion holds.
"""


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    parser = add_command(
        subparsers,
        "aot",
        run,
        help="compile a train step for a mesh rule ahead of time: memory, FLOPs, MFU",
        description="Compile the training step for a mesh rule's mesh without running it and "
        "report per-device memory against the device's HBM, FLOPs per step and MFU.",
        epilog=EPILOG,
    )
    parser.add_argument("--preset", required=True, help="preset name")
    parser.add_argument(
        "--mesh-rule",
        required=True,
        metavar="NAME|SELECTOR",
        help="a mesh rule name (cpu, gpu-h100-8x32) or a selector it matches",
    )
    add_config_arguments(parser)
    parser.add_argument(
        "--max-devices",
        type=int,
        default=64,
        help="most fake CPU devices to compile for (default 64)",
    )
    parser.add_argument("--target-mfu", type=float, default=0.4, help="default 0.4")
    parser.add_argument("--step-time", type=float, help="seconds per step: report its MFU")
    parser.add_argument("--hbm-gib", type=float, help="override the device's HBM (GiB)")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument(
        "--dump",
        metavar="DIR",
        help="also write the step's StableHLO before XLA's optimizations "
        "(train_step.before_optimizations.mlir), the optimized HLO "
        "(train_step.after_optimizations.hlo.txt) and the memory and cost analysis "
        "(train_step.analysis.json) to DIR; ops carry their module path (decoder/.../attention)",
    )
    return parser


def build_config(args: argparse.Namespace):
    """(config, rule name, device spec, target device count) for the parsed arguments."""
    from axplug.api.config import apply_overrides, make_modifier, preset_config
    from axplug.api.sharding import device_spec_of, resolve_rule, selector_device_count

    cfg: Any = preset_config(args.preset, overrides=["output_dir='/nonexistent/axplug-aot'"])
    name, rule = resolve_rule(args.mesh_rule)
    cfg = rule.modifier()(cfg)
    for spec in args.modifier:
        cfg = make_modifier(spec)(cfg)
    cfg = apply_overrides(cfg, args.overrides)
    spec = device_spec_of(name)
    if spec is not None and args.hbm_gib is not None:
        spec = dataclasses.replace(spec, hbm_bytes=int(args.hbm_gib * 1024**3))
    count = selector_device_count(args.mesh_rule)
    if count is None:
        shape = tuple(cfg.mesh.mesh_shape)
        count = abs(_prod(shape)) if -1 not in shape else _local_device_count()
    return cfg, name, spec, count


def _prod(shape) -> int:
    out = 1
    for d in shape:
        out *= d
    return out


def _local_device_count() -> int:
    import jax

    return jax.device_count()


def _ensure_devices(n: int) -> bool:
    """True when jax has (or can still be given) `n` CPU devices in this process."""
    import jax

    try:
        jax.config.update("jax_platforms", "cpu")
        jax.config.update("jax_num_cpu_devices", n)
    except RuntimeError:  # backends already started
        pass
    return jax.device_count() >= n and jax.default_backend() == "cpu"


def _argv(args: argparse.Namespace) -> list[str]:
    """The `aot` command line that reproduces `args`."""
    argv = ["aot", "--preset", args.preset, "--mesh-rule", args.mesh_rule]
    argv += [f"--modifier={m}" for m in args.modifier]
    argv += [f"--set={o}" for o in args.overrides]
    argv += ["--max-devices", str(args.max_devices), "--target-mfu", str(args.target_mfu)]
    for flag, value in (("--step-time", args.step_time), ("--hbm-gib", args.hbm_gib)):
        if value is not None:
            argv += [flag, str(value)]
    if args.dump is not None:
        argv += ["--dump", args.dump]
    return argv + (["--json"] if args.json else [])


def _rerun(n: int, args: argparse.Namespace) -> int:
    env = dict(os.environ, JAX_PLATFORMS="cpu", **{_CHILD_ENV: "1"})
    flags = [f for f in env.get("XLA_FLAGS", "").split() if "device_count" not in f]
    env["XLA_FLAGS"] = " ".join([*flags, f"--xla_force_host_platform_device_count={n}"])
    sys.stdout.flush()
    return subprocess.call([sys.executable, "-m", "axplug.cli", *_argv(args)], env=env)


def run(args: argparse.Namespace) -> int:
    from axplug.api.config import UsageError
    from axplug_aot.report import check_batch, scale_down
    from axplug_aot.topology import compile_only_devices

    cfg, name, spec, count = build_config(args)
    shape = cfg.mesh.instantiate().resolved_shape(count)
    check_batch(shape, cfg.mesh.axis_names, cfg.input.batch_size)
    devices, devices_note = None, None
    if spec is not None:
        devices, devices_note = compile_only_devices(spec.platform, args.mesh_rule, count)
    if devices is None:
        _, _, factor = scale_down(
            shape, cfg.mesh.axis_names, cfg.input.batch_size, args.max_devices
        )
    if devices is None and not _ensure_devices(needed := _prod(shape) // factor):
        if os.environ.get(_CHILD_ENV):
            raise UsageError(f"could not get {needed} fake CPU devices (--max-devices)")
        return _rerun(needed, args)
    return _report(args, cfg, name, spec, count, devices, devices_note)


def _report(args, cfg, name, spec, count, devices, devices_note) -> int:
    from axplug_aot.report import compile_report

    report = compile_report(
        cfg,
        num_devices=count,
        spec=spec,
        preset=args.preset,
        rule=name,
        selector=args.mesh_rule,
        max_devices=args.max_devices,
        target_mfu=args.target_mfu,
        step_time_s=args.step_time,
        devices=devices,
        devices_note=devices_note,
        dump_dir=args.dump,
    )
    if args.json:
        print(json.dumps(report.to_dict(), indent=2))
    else:
        print(format_report(report))
    if report.fits is False:
        print(
            f"error: would OOM by {report.over_bytes / 1024**3:.2f} GiB per device "
            f"({report.memory['total'] / 1024**3:.2f} GiB needed, "
            f"{(report.hbm_bytes or 0) / 1024**3:.2f} GiB HBM on {report.device}); "
            "shard more (mesh:fsdp=...), remat more (scan_layers:remat_policy=full), "
            "or use a smaller per-device batch",
            file=sys.stderr,
        )
        return EXIT_OOM
    return 0


def _count(n: int) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.2f}{unit}"
    return str(n)


def format_report(r) -> str:
    """The human-readable report."""
    gib = 1024**3
    mesh = ", ".join(f"{k}={v}" for k, v in r.mesh_shape.items() if v != 1) or "1 device"
    lines = [
        f"{r.preset} on {r.rule} ({r.device or 'no device spec'}): {r.num_devices} devices, "
        f"mesh {mesh}, {_count(r.params)} params, {r.tokens_per_step} tokens/step",
    ]
    if r.active_params < r.params:
        lines.append(f"  {_count(int(r.active_params))} params active per token (FLOPs, MFU)")
    if r.scale_factor > 1:
        lines.append(
            f"  compiled on {r.compiled_devices} fake devices: data axis and batch / "
            f"{r.scale_factor} (per-device memory unchanged)"
        )
    if r.pipeline:
        p = r.pipeline
        virtual = f" x {p['repeats']} virtual" if p["repeats"] > 1 else ""
        lines.append(
            f"  pipeline: {p['stages']} stages{virtual} x {p['microbatches']} microbatches "
            f"({p['schedule']}), bubble {p['bubble']:.1%}; one stage per `pipeline` device, so "
            "per-device memory is per stage"
        )
        if "bubble_1f1b" in p and p["schedule"] != "1f1b":
            lines.append(
                f"  1f1b at the same stages and microbatches: bubble {p['bubble_1f1b']:.1%}"
            )
        if "table" in p:
            lines.append("  schedule (a column per tick; F forward, B backward, Bi input and W")
            lines.append("  weight gradients, each with its microbatch):")
            lines += [f"    {row}" for row in p["table"].splitlines()]
    if r.context_parallel:
        lines.append(f"  context parallel: {r.context_parallel['description']}")
    lines.append("  per-device memory (GiB; temp: activations and scratch):")
    for key in ("params", "optimizer", "batch", "temp", "total"):
        lines.append(f"    {key:<10} {r.memory[key] / gib:12.4f}")
    if r.memory.get("host"):
        lines.append(
            f"    {'host':<10} {r.memory['host'] / gib:12.4f}  (pinned host memory, not HBM)"
        )
    if r.hbm_bytes is not None:
        verdict = "fits" if r.fits else f"would OOM by {r.over_bytes / gib:.2f} GiB"
        lines.append(f"    {'HBM':<10} {r.hbm_bytes / gib:12.4f}  -> {verdict}")
    xla = f"{r.flops_per_step_xla:.3e}" if r.flops_per_step_xla is not None else "n/a"
    lines.append(f"  FLOPs/step: analytic {r.flops_per_step_analytic:.3e}, XLA cost analysis {xla}")
    if r.step_time_at_target_mfu_s is not None:
        lines.append(
            f"  step time at {r.target_mfu:.0%} MFU: {r.step_time_at_target_mfu_s:.4g} s "
            f"(peak {r.peak_flops_per_device / 1e12:.0f} TFLOP/s per chip)"
        )
    if r.mfu_at_step_time is not None:
        lines.append(f"  MFU at {r.step_time_s} s/step: {r.mfu_at_step_time:.1%}")
    if r.collectives:
        found = ", ".join(f"{op} {n}" for op, n in sorted(r.collectives.items()))
        lines.append(f"  collectives in the compiled step: {found}")
    lines.append(f"  compile time {r.compile_s:.1f} s")
    lines += [f"  note: {note}" for note in r.notes]
    return "\n".join(lines)
