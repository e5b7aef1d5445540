"""Per-device cost of the compiled train step as the mesh grows, from XLA's own analysis.

For each layout (a preset plus modifiers) the step is compiled on fake CPU devices at each
device count, one sequence per batch shard (weak scaling), and the table shows per-device
FLOPs and temp memory (`cost_analysis()` / `memory_analysis()`, deterministic) as ratios to
the smallest count, and the collectives in the partitioned HLO. Sequence parallelism is strong
scaling instead: one long sequence, ratios to one device (ideal 1/N).

    python bench/scaling.py                 # every layout, 8 -> 64 devices (about 10 minutes)
    python bench/scaling.py --quick         # 8 -> 16 devices
    python bench/scaling.py --layout fsdp-scan --devices 8,64 --json
    python bench/scaling.py --layout moe+alltoall-dropfree --tpu    # TPU v5p, libtpu
    python bench/scaling.py --layout moe+alltoall-dropfree --tpu --exchange padded

`--tpu` compiles for TPU v5p slices of each size through libtpu's compile-only client (pip
install libtpu), where the drop-free all-to-all moves rows by ragged all-to-all (`--exchange
auto`); `--exchange padded` plans the static-buffer fallback instead.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

MAX_DEVICES = 64
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={MAX_DEVICES}"
)
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

# Weak-scaling layouts: (preset, modifiers); the global batch is one sequence per batch shard.
LAYOUTS = {
    "data": ("llama-tiny", ["mesh:data=-1"]),
    "fsdp-scan": ("llama-tiny", ["mesh:fsdp=-1", "scan_layers:remat_policy=full"]),
    "fsdp": ("llama-tiny", ["mesh:fsdp=-1"]),
    "fsdp+model": ("llama-tiny", ["mesh:fsdp=-1,model=2", "scan_layers:remat_policy=full"]),
    "moe+expert": (
        "llama-tiny",
        ["moe:num_experts=8,top_k=2", "mesh:fsdp=-1,expert=4", "scan_layers:remat_policy=full"],
    ),
    # Experts grow with the devices ({n}: the device count): 2 per device over expert=n/2,
    # tokens moved by the explicit all-to-all dispatch.
    "moe+alltoall": (
        "llama-tiny",
        [
            "moe:num_experts={n},top_k=2,dispatch=alltoall",
            "mesh:fsdp=2,expert={half}",
            "scan_layers:remat_policy=full",
        ],
    ),
    # The same drop-free: each device may send all its choices to one shard, so its send
    # and receive buffers grow with the expert shards (ragged all-to-all would not).
    "moe+alltoall-dropfree": (
        "llama-tiny",
        [
            "moe:num_experts={n},top_k=2,capacity_factor=None,dispatch=alltoall",
            "mesh:fsdp=2,expert={half}",
            "scan_layers:remat_policy=full",
        ],
    ),
}
# Strong scaling along the sequence: one sequence of SEQ_LEN tokens.
SEQ_LAYOUT = ("llama-tiny", ["scan_layers:remat_policy=full"])
SEQ_LEN = 4096


def measure(
    preset: str, modifiers: list[str], devices: int, overrides: list[str], target=None
) -> dict:
    """Per-device FLOPs, temp bytes and collective counts of the compiled step; `target`:
    (platform, exchange) for a TPU compile and the all-to-all's exchange, None: fake CPUs."""
    from axplug_aot.report import compile_report

    from axplug.presets import preset_config

    cfg = preset_config(preset, modifiers=modifiers, overrides=overrides)
    place = {}
    if target is not None:
        from axplug_aot.topology import compile_only_devices
        from axplug_moe.alltoall import AllToAllDispatch
        from axplug_tpu.specs import V5P

        from axplug.config import find_configs

        for _, dispatch in find_configs(cfg, AllToAllDispatch):
            dispatch.exchange = target[1]
        chips, note = compile_only_devices("tpu", f"tpu-v5p-{devices}", devices)
        if chips is None:
            sys.exit(f"error: no TPU compile: {note}")
        place = dict(devices=chips, devices_note=note, spec=V5P)
    report = compile_report(cfg, num_devices=devices, max_devices=devices, **place)
    return {
        "devices": devices,
        "flops": report.flops_per_step_xla / devices,
        "temp": report.memory["temp"],
        "collectives": report.collectives,
        "compile_s": report.compile_s,
    }


def weak_scaling(name: str, counts: list[int], target=None) -> list[dict]:
    preset, layout = LAYOUTS[name]
    rows = []
    for n in counts:
        modifiers = [m.format(n=n, half=n // 2) for m in layout]
        # One sequence per batch shard: batch axes are every mesh axis but model.
        model = 2 if "model=2" in " ".join(modifiers) else 1
        rows.append(measure(preset, modifiers, n, [f"input.batch_size={n // model}"], target))
    return rows


def seq_scaling(counts: list[int]) -> list[dict]:
    preset, modifiers = SEQ_LAYOUT
    over = ["input.batch_size=1", f"input.seq_len={SEQ_LEN}"]
    rows = [measure(preset, [*modifiers, "mesh:data=1"], 1, over)]
    for n in counts:
        rows.append(measure(preset, [*modifiers, f"mesh:seq={n}"], n, over))
    return rows


def _table(title: str, rows: list[dict]) -> str:
    base = rows[0]
    lines = [
        title,
        f"  {'devices':>7} {'GFLOP/dev':>10} {'x':>6} {'temp MiB':>9} {'x':>6}  collectives",
    ]
    for r in rows:
        coll = ", ".join(f"{k} {v}" for k, v in sorted(r["collectives"].items())) or "-"
        lines.append(
            f"  {r['devices']:>7} {r['flops'] / 1e9:>10.3f} {r['flops'] / base['flops']:>6.3f} "
            f"{r['temp'] / 2**20:>9.1f} {r['temp'] / max(base['temp'], 1):>6.3f}  {coll}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="8 -> 16 devices only")
    parser.add_argument("--devices", help="comma-separated device counts (default 8,64)")
    parser.add_argument(
        "--layout", action="append", choices=[*LAYOUTS, "seq"], help="repeatable; default all"
    )
    parser.add_argument("--json", action="store_true", help="one JSON object per layout")
    parser.add_argument("--tpu", action="store_true", help="compile for TPU v5p (libtpu)")
    parser.add_argument("--exchange", default="auto", choices=["auto", "padded", "ragged"])
    args = parser.parse_args(argv)
    target = ("tpu", args.exchange) if args.tpu else None
    counts = [int(c) for c in (args.devices or ("8,16" if args.quick else "8,64")).split(",")]
    start = time.perf_counter()
    print(f"jax {jax.__version__}, {jax.device_count()} fake CPU devices", file=sys.stderr)
    for name in args.layout or [*LAYOUTS, "seq"]:
        rows = seq_scaling(counts) if name == "seq" else weak_scaling(name, counts, target)
        if args.json:
            print(json.dumps({"layout": name, "rows": rows}))
        else:
            kind = (
                f"strong scaling, one {SEQ_LEN}-token sequence, mesh:seq=N"
                if name == "seq"
                else "weak scaling, one sequence per batch shard"
            )
            print(_table(f"{name} ({kind})", rows), flush=True)
    print(f"done in {time.perf_counter() - start:.0f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
