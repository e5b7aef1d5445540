"""Compile time of the llama-tiny training step against depth: unrolled vs scanned layers.

    python bench/deep_stack.py [--layers 4,32] [--remat-policy none]

For each depth it compiles (trace + lower + XLA compile, nothing runs) the axplug training
step twice: `StackedTransformer` (every layer unrolled into the program) and the
`scan_layers` modifier (`RepeatedTransformer`: one layer body under `lax.scan`). Each compile
is of a fresh Trainer, with the persistent cache off. The growth columns divide each time by
the time at the smallest depth: unrolled grows about linearly with depth, scanned stays flat.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import jax

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import step_time  # noqa: E402

__all__ = ["compile_seconds", "main"]


def compile_seconds(layers: int, scanned: bool, remat_policy: str = "none") -> tuple[float, int]:
    """(trace + lower + compile seconds, HLO lines) of the step at `layers` layers."""
    extra = [f"model.decoder.transformer.num_layers={layers}"]
    cfg = step_time.shape_config("llama-tiny", tuple(extra))
    if scanned:
        from axplug.modifiers import make_modifier

        cfg = make_modifier("scan_layers")(cfg)
        cfg.model.decoder.transformer.set(num_layers=layers, remat_policy=remat_policy)
    side = step_time.AxplugSide(cfg)
    t0 = time.perf_counter()
    compiled = side.jitted.lower(*side.abstract_args()).compile()
    return time.perf_counter() - t0, compiled.as_text().count("\n")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", default="4,32", help="comma-separated depths")
    p.add_argument("--remat-policy", default="none", help="of the scanned stack")
    args = p.parse_args(argv)
    depths = sorted(int(x) for x in args.layers.split(","))
    jax.config.update("jax_enable_compilation_cache", False)
    print(
        f"llama-tiny step compile time by depth (trace+lower+compile, jax {jax.__version__}, "
        f"scan remat {args.remat_policy})"
    )
    print(
        f"{'layers':>6} {'unrolled s':>11} {'growth':>7} {'HLO':>7} {'scanned s':>10} "
        f"{'growth':>7} {'HLO':>7} {'unrolled/scanned':>17}"
    )
    base: dict[bool, float] = {}
    rows = []
    for n in depths:
        (tu, hu), (ts, hs) = compile_seconds(n, False), compile_seconds(n, True, args.remat_policy)
        base.setdefault(False, tu)
        base.setdefault(True, ts)
        rows.append((n, tu, ts))
        print(
            f"{n:6d} {tu:11.2f} {tu / base[False]:7.2f} {hu:7d} {ts:10.2f} {ts / base[True]:7.2f} "
            f"{hs:7d} {tu / ts:17.2f}"
        )
    n, tu, ts = rows[-1]
    print(
        f"deep stack ({n} layers): unrolled compile grew {tu / base[False]:.2f}x from "
        f"{depths[0]} layers, scanned {ts / base[True]:.2f}x"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
