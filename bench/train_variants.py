"""Step time and compiled memory of one preset under several modifier sets, interleaved.

    python bench/train_variants.py                                   # llama-tiny on CPU
    python bench/train_variants.py --devices 4 \
        --variant pp=scan_layers+pipeline:stages=4+mesh:pipeline=4
    python bench/train_variants.py --set model.decoder.dim=2048 ...  # on a GPU: bigger shapes

Each variant is `NAME=MODIFIER+MODIFIER...` applied to the preset (then `--set` overrides).
Every variant's step is compiled once; then `--rounds` rounds run `--steps` steps of each
variant in turn (interleaved, so a noisy machine slows all alike). Printed per variant:
the compiled step's per-device temp memory (activations kept for the backward pass and
scratch) and host memory, per-device parameter bytes, the first step's loss, and the median
step time with its min-max spread over the rounds' medians, as ratios to the first variant.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

DEFAULT_VARIANTS = [
    "scan-full=scan_layers:remat_policy=full",
    "int8=scan_layers:remat_policy=full+quantize:int8",
    "fp8=scan_layers:remat_policy=full+quantize:fp8",
    "offload=scan_layers:remat_policy=offload",
    "gpipe-s4-m8=scan_layers:remat_policy=full+pipeline:stages=4,microbatches=8",
    "circular-s2-m8-r2=scan_layers:remat_policy=full"
    "+pipeline:stages=2,microbatches=8,schedule=circular",
    "1f1b-s4-m8=scan_layers:remat_policy=full+pipeline:stages=4,microbatches=8,schedule=1f1b",
]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="llama-tiny")
    p.add_argument("--set", action="append", default=[], metavar="PATH=VALUE")
    p.add_argument("--variant", action="append", default=None, metavar="NAME=MOD+MOD")
    p.add_argument("--devices", type=int, default=1, help="fake CPU devices (CPU only)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=3, help="steps per variant per round")
    p.add_argument("--gemms", action="store_true", help="print each step's compiled GEMMs")
    return p.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.devices > 1:
        os.environ["XLA_FLAGS"] = (
            os.environ.get("XLA_FLAGS", "")
            + f" --xla_force_host_platform_device_count={args.devices}"
        )
    import jax

    from axplug.presets import preset_config

    variants = []
    for spec in args.variant or DEFAULT_VARIANTS:
        name, _, mods = spec.partition("=")
        modifiers = [m for m in mods.split("+") if m]
        cfg = preset_config(
            args.preset,
            modifiers=modifiers,
            overrides=[
                "output_dir='/tmp/axplug-train-variants'",
                "compilation_cache_dir=None",
                "summary_writers=[]",
                *args.set,
            ],
        )
        trainer = cfg.instantiate(devices=jax.devices()[: _devices_for(cfg)])
        state = trainer.init_state()
        batch = trainer.put_batch(trainer.input.batch(0))
        t0 = time.perf_counter()
        step = trainer._train_step.lower(state, batch).compile()
        compile_s = time.perf_counter() - t0
        mem = step.memory_analysis()
        params = sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(state["params"]))
        state, metrics = step(state, batch)
        variants.append(
            {
                "name": name,
                "step": step,
                "state": state,
                "batch": batch,
                "loss": float(metrics["loss"]),
                "temp": mem.temp_size_in_bytes,
                "host": getattr(mem, "host_temp_size_in_bytes", 0) or 0,
                "params": params,
                "compile_s": compile_s,
                "rounds": [],
            }
        )
        print(f"compiled {name} in {compile_s:.1f} s", file=sys.stderr)
        if args.gemms:
            from quantized_matmul import gemm_census

            print(f"{name} GEMMs: {gemm_census(step.as_text())}")

    for _ in range(args.rounds):
        for v in variants:
            times = []
            for _ in range(args.steps):
                t0 = time.perf_counter()
                v["state"], metrics = v["step"](v["state"], v["batch"])
                jax.block_until_ready(metrics["loss"])
                times.append(time.perf_counter() - t0)
            v["rounds"].append(statistics.median(times))

    base = variants[0]
    base_time = statistics.median(base["rounds"])
    print(
        f"{args.preset} on {jax.devices()[0].device_kind} ({len(jax.devices())} devices), "
        f"{args.rounds} rounds x {args.steps} steps, jax {jax.__version__}"
    )
    print(
        "| variant | first loss | params/device MiB | temp MiB | host MiB "
        "| step ms median [min-max] | time x | temp x |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    mib = 2**20
    for v in variants:
        med = statistics.median(v["rounds"])
        print(
            f"| {v['name']} | {v['loss']:.5f} | {v['params'] / mib:.2f} | {v['temp'] / mib:.1f} "
            f"| {v['host'] / mib:.1f} | {med * 1e3:.1f} [{min(v['rounds']) * 1e3:.1f}-"
            f"{max(v['rounds']) * 1e3:.1f}] | {med / base_time:.2f} | "
            f"{v['temp'] / max(base['temp'], 1):.2f} |"
        )


def _devices_for(cfg) -> int:
    """Devices a config's mesh takes: its fixed product, or all with a -1 axis."""
    import math

    import jax

    shape = tuple(cfg.mesh.mesh_shape)
    return len(jax.devices()) if -1 in shape else math.prod(shape)


if __name__ == "__main__":
    main()
