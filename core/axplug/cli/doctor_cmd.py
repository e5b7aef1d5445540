"""`axplug doctor`: the environment, and every installed plugin imported in isolation."""

from __future__ import annotations

import argparse
import os
import platform
import sys
from typing import Any

from axplug.api import add_command

__all__ = ["add_parser", "run", "collect", "PROBLEM_STATUSES"]

# Statuses that make `axplug doctor` exit 1; `conflict` and `disabled` are reported only, but a
# distribution reusing a first-party name (registry.shadowing_first_party) fails it too.
PROBLEM_STATUSES = ("broken", "incompatible")
_SHADOWING = "reuses a first-party name"
IMPORT_TIMEOUT_S = 30.0  # per plugin import: one that hangs is reported, not waited for

EPILOG = """\
examples:
  axplug doctor            a report; exit 1 if a plugin is broken or incompatible
  axplug doctor --json     the same as one JSON object for scripts and bug reports

Every plugin component is imported on its own, so one broken plugin never hides the others;
each problem comes with the fix (upgrade, reinstall, or skip with AXPLUG_DISABLE_PLUGINS).
"""


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    parser = add_command(
        subparsers,
        "doctor",
        run,
        help="check the environment and every installed plugin",
        description="Report Python, jax and device versions, and import every installed "
        "plugin in isolation, naming what is broken and how to fix it.",
        epilog=EPILOG,
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    return parser


def _version(dist: str) -> str | None:
    import importlib_metadata

    try:
        return importlib_metadata.version(dist)
    except importlib_metadata.PackageNotFoundError:
        return None


def _jax_requirement() -> str | None:
    """The core's own `jax` requirement, e.g. `jax>=0.10.2`."""
    import importlib_metadata

    try:
        requires = importlib_metadata.requires("axplug") or []
    except importlib_metadata.PackageNotFoundError:
        return None
    return next((r for r in requires if r.split(">")[0].split("=")[0].split("<")[0] == "jax"), None)


def _satisfies(version: str | None, requirement: str | None) -> bool | None:
    if version is None or requirement is None:
        return None
    try:
        from packaging.requirements import Requirement
    except ImportError:
        return None
    return Requirement(requirement).specifier.contains(version, prereleases=True)


def environment() -> dict[str, Any]:
    """Python, jax/jaxlib against the supported range, devices, and the settings that matter."""
    from axplug import PLUGIN_API_VERSION, __version__
    from axplug.registry import SUPPORTED_PLUGIN_API

    info: dict[str, Any] = {
        "python": platform.python_version(),
        "executable": sys.executable,
        "platform": platform.platform(),
        "axplug": __version__,
        "plugin_api": PLUGIN_API_VERSION,
        "supported_plugin_api": list(SUPPORTED_PLUGIN_API),
        "jax": _version("jax"),
        "jaxlib": _version("jaxlib"),
        "jax_requirement": _jax_requirement(),
    }
    info["jax_supported"] = _satisfies(info["jax"], info["jax_requirement"])
    try:
        import jax

        devices = jax.devices()
        info["backend"] = jax.default_backend()
        info["devices"] = [f"{d.platform}:{d.id} {d.device_kind}" for d in devices]
        info["device_error"] = None
    except Exception as exc:  # no backend at all is exactly what doctor must report
        info.update(backend=None, devices=[], device_error=f"{type(exc).__name__}: {exc}")
    from axplug.trainer.compilation import DEFAULT_CACHE_DIR, cache_dir_for

    # Where a run's programs go by default: axplug's directory, or the environment's.
    cache = cache_dir_for(DEFAULT_CACHE_DIR) or os.environ["JAX_COMPILATION_CACHE_DIR"]
    info["env"] = {
        k: os.environ.get(k)
        for k in ("XLA_FLAGS", "JAX_PLATFORMS", "AXPLUG_DISABLE_PLUGINS", "AXPLUG_LOAD_PLUGINS")
    }
    info["compilation_cache_dir"] = cache
    info["compilation_cache_writable"] = _writable(cache)
    return info


def _writable(path: str) -> bool:
    while not os.path.exists(path):
        parent = os.path.dirname(path)
        if parent == path:
            return False
        path = parent
    return os.access(path, os.W_OK)


# Each failure kind the registry records (axplug.registry.FAILURES), in words.
_PROBLEMS = {
    "api": "plugin API mismatch",
    "conflict": "name collision",
    "group": "unknown entry-point group",
    "missing": "entry point points at nothing",
    "import": "import error",
    "hang": "import hangs",
    "hooks": "hooks the core does not define",
    "kind": "not what its kind declares",
}


def _problem(component) -> str | None:
    """What kind of problem a non-ok component has, in words (from its recorded failure)."""
    if component.status not in ("broken", "incompatible", "conflict"):
        return None
    return _PROBLEMS.get(component.failure or "", component.status)


def _kernel_note(obj: Any, backend: str | None) -> str | None:
    """Why a kernel cannot run here, asked on a small causal problem; None when it can."""
    try:
        import jax
        import jax.numpy as jnp

        from axplug import registry
        from axplug.api import Kernel, PagedKV, why_unsupported
        from axplug.kernels.dispatch import example_call

        kernel, backend, bf16 = registry.conformed(obj, Kernel), backend or "cpu", jnp.bfloat16
        if kernel.paged:  # a paged-attention kernel: one decode step
            pages = jax.ShapeDtypeStruct((8, 64, 16, 128), bf16)
            rows, table = (jax.ShapeDtypeStruct(s, jnp.int32) for s in ((1,), (1, 8)))
            query = jax.ShapeDtypeStruct((1, 8, 128), bf16)
            answer = kernel.is_supported(query, PagedKV(pages, pages, table, rows), backend)
        elif kernel.grouped_matmul:  # 4 groups' matmuls over 256 rows
            lhs, rhs = (jax.ShapeDtypeStruct(s, bf16) for s in ((256, 128), (4, 128, 128)))
            sizes = jax.ShapeDtypeStruct((4,), jnp.int32)
            answer = kernel.is_supported(lhs, rhs, sizes, backend)
        else:
            answer = kernel.is_supported(*example_call(seq=128, head_dim=64), backend)
    except Exception as exc:
        return f"is_supported failed: {type(exc).__name__}: {exc}"
    return None if answer else f"unavailable here: {why_unsupported(answer)}"


def collect() -> dict[str, Any]:
    """The whole report: `environment`, `distributions` (each with its components), `ok`."""
    import contextlib

    from axplug import registry
    from axplug.cli.list_cmd import as_dict
    from axplug.registry._loading import load_component

    env = environment()
    notes: dict[tuple[str, str, str], str] = {}
    for c in registry.discover():
        if not c.loadable or c.kind not in registry.KINDS:
            continue
        # A failure or a hang is recorded; hooks are imported here first for the same reason.
        if not registry.load_within(c, IMPORT_TIMEOUT_S) or c.kind == "hooks":
            continue
        obj = load_component(c)
        if c.kind == "kernels" and (note := _kernel_note(obj, env.get("backend"))):
            notes[c.key] = note
    with contextlib.suppress(Exception):
        registry.plugin_manager()  # imports hooks plugins, rejects hooks the core lacks
    dists: dict[str, dict[str, Any]] = {}
    shadowing = {c.key for c in registry.shadowing_first_party(registry.discover())}
    for c in registry.discover():
        d = dists.setdefault(
            c.distribution, {"distribution": c.distribution, "version": c.version, "components": []}
        )
        problem = _SHADOWING if c.key in shadowing else _problem(c)
        row = {"failure": c.failure, "problem": problem, "note": notes.get(c.key)}
        d["components"].append(as_dict(c) | row)
    for d in dists.values():
        statuses = {row["status"] for row in d["components"]}
        d["status"] = next((s for s in PROBLEM_STATUSES if s in statuses), "ok")
        if any(row["problem"] == _SHADOWING for row in d["components"]):
            d["status"] = "conflict"
    ok = env["device_error"] is None and all(d["status"] == "ok" for d in dists.values())
    return {"environment": env, "distributions": list(dists.values()), "ok": ok}


def run(args: argparse.Namespace) -> int:
    report = collect()
    if args.json:
        import json

        print(json.dumps(report, indent=2))
    else:
        _print(report)
    return 0 if report["ok"] else 1


def _print(report: dict[str, Any]) -> None:
    env = report["environment"]
    supported = {True: "ok", False: "NOT SUPPORTED", None: "unknown"}[env["jax_supported"]]
    lines = [
        f"python     {env['python']} ({env['executable']})",
        f"axplug     {env['axplug']}, plugin API {env['plugin_api']} "
        f"(loads {env['supported_plugin_api'][0]} to {env['supported_plugin_api'][1]})",
        f"jax        {env['jax']}, jaxlib {env['jaxlib']}; core needs "
        f"{env['jax_requirement']}: {supported}",
        f"backend    {env['backend']}: {len(env['devices'])} device(s) "
        + (", ".join(env["devices"][:4]) + (" ..." if len(env["devices"]) > 4 else "")),
    ]
    if env["device_error"]:
        lines.append(f"  PROBLEM  no devices: {env['device_error']}")
    for key, value in env["env"].items():
        lines.append(f"{key:<26} {value if value is not None else '(unset)'}")
    writable = "writable" if env["compilation_cache_writable"] else "NOT writable"
    lines.append(f"compilation cache          {env['compilation_cache_dir']} ({writable})")
    lines.append("")
    for d in report["distributions"]:
        lines.append(f"{d['distribution']} {d['version']}: {d['status']}")
        for row in d["components"]:
            if row["status"] == "ok" and not row["note"]:
                continue
            if row["status"] != "ok":
                what = row["problem"] or row["status"]
                lines.append(f"  {row['kind']} {row['name']}: {what}: {row['reason'] or ''}")
            if row["note"]:
                lines.append(f"  {row['kind']} {row['name']}: {row['note']}")
        counts = sum(row["status"] == "ok" for row in d["components"])
        lines.append(f"  {counts}/{len(d['components'])} component(s) ok")
    bad = [d["distribution"] for d in report["distributions"] if d["status"] != "ok"]
    lines.append("")
    lines.append("all good" if report["ok"] else f"problems in: {', '.join(bad) or 'environment'}")
    print("\n".join(lines))
