"""The step-time comparison of `step_time.py` on one GPU, for a ~1B-parameter LLaMA shape.

    python bench/gpu_step_time.py [--device-spec h200] [--attention flash|xla] [--no-flax]
                                  [--dim 2048 --layers 16 --heads 16 --hidden 5632
                                   --vocab 32000 --seq 1024 --batch 8 --compute-dtype bfloat16]

axplug, plain JAX and Flax NNX run the llama-tiny recipe (RMSNorm, SwiGLU, RoPE) at these
shapes (0.95B parameters by default) with float32 parameters and bfloat16 compute, from the
same initial parameters (first-step losses must agree to 2e-2 relative in bfloat16). With
`--attention flash` (the default) axplug applies its `flash_attention` modifier (cuDNN on the
GPU) and plain JAX calls `jax.nn.dot_product_attention(implementation="cudnn")`; Flax NNX
runs only with `--attention xla`. MFU is printed twice against the dense bf16 peak of the
GPU's device spec from the axplug-gpu plugin (detected from the device kind, or
`--device-spec`): by the plain-jax step's XLA FLOPs (which leave out cuDNN's attention) and
by the model's FLOPs (6 x params per token + attention, as the trainer's `mfu`).
The defaults (one warm-up compile per side, no extra compiles, 4 rounds x 5 steps) take a few
minutes on an H100/H200; the three sides' states (~16 GB each) stay resident together.
Exits 2 with a message when JAX sees no GPU.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

__all__ = ["parse_args", "overrides", "device_spec", "main"]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device-spec", default=None, help="a100/h100/h200/b200; default: detect")
    p.add_argument("--dim", type=int, default=2048)
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--hidden", type=int, default=5632, help="SwiGLU hidden size")
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--compute-dtype", default="bfloat16", choices=("bfloat16", "float32"))
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--steps-per-round", type=int, default=5)
    p.add_argument("--compile-reps", type=int, default=0, help="fresh compiles per side")
    p.add_argument("--no-flax", action="store_true", help="axplug and plain JAX only")
    p.add_argument(
        "--attention",
        default="flash",
        choices=("flash", "xla"),
        help="flash: axplug's flash_attention modifier (cuDNN on a GPU) against "
        "jax.nn.dot_product_attention(implementation='cudnn'); xla: einsum attention on both",
    )
    args = p.parse_args(argv)
    for name in ("dim", "layers", "heads", "hidden", "vocab", "seq", "batch", "rounds"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.dim % args.heads:
        p.error(f"--dim {args.dim} is not divisible by --heads {args.heads}")
    return args


def overrides(args: argparse.Namespace) -> tuple[str, ...]:
    """The llama-tiny overrides that give the benchmarked shape."""
    return (
        f"model.decoder.dim={args.dim}",
        f"model.decoder.vocab_size={args.vocab}",
        f"model.decoder.transformer.num_layers={args.layers}",
        f"model.decoder.transformer.layer.attention.num_heads={args.heads}",
        f"model.decoder.transformer.layer.feed_forward.hidden_dim={args.hidden}",
        f"model.compute_dtype={args.compute_dtype!r}",
        f"input.seq_len={args.seq}",
        f"input.batch_size={args.batch}",
    )


def device_spec(device_kind: str, name: str | None = None):
    """The axplug-gpu DeviceSpec named `name`, or the one whose key is in `device_kind`."""
    try:
        from axplug_gpu.specs import SPECS
    except ImportError:
        raise SystemExit(
            "gpu_step_time.py needs the axplug-gpu plugin: pip install -e plugins/hw_gpu"
        ) from None
    if name is not None:
        if name.lower() not in SPECS:
            raise SystemExit(f"--device-spec {name!r}: choose from {', '.join(sorted(SPECS))}")
        return SPECS[name.lower()]
    for key, spec in SPECS.items():
        if key in device_kind.lower():
            return spec
    raise SystemExit(
        f"no axplug-gpu device spec matches device kind {device_kind!r}; pass --device-spec "
        f"({', '.join(sorted(SPECS))})"
    )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import jax

    if jax.default_backend() != "gpu":
        print(
            f"gpu_step_time.py needs a GPU, but JAX's backend is {jax.default_backend()!r} "
            f"(devices: {jax.devices()}). Install a CUDA jaxlib (pip install 'jax[cuda12]') on a "
            "machine with an NVIDIA GPU; on CPU run bench/step_time.py instead.",
            file=sys.stderr,
        )
        return 2
    import step_time

    spec = device_spec(jax.devices()[0].device_kind, args.device_spec)
    jax.config.update("jax_enable_compilation_cache", False)
    print(
        f"{jax.devices()[0].device_kind} (spec: {spec.name}, {spec.peak_bf16_flops / 1e12:.0f} "
        f"TFLOP/s dense bf16), jax {jax.__version__}"
    )
    modifiers = ("flash_attention",) if args.attention == "flash" else ()
    cfg = step_time.shape_config("llama-tiny", overrides(args), modifiers)
    result = step_time.run_shape(
        "llama-1b",
        cfg,
        rounds=args.rounds,
        steps_per_round=args.steps_per_round,
        compile_reps=args.compile_reps,
        peak=spec.peak_bf16_flops,
        peak_label=f"{spec.name} dense bf16 peak",
        flax=not args.no_flax and args.attention == "xla",
    )
    if result is None:
        return 1
    step_time.print_summary([result])
    ratio = result["median"]["axplug"] / result["median"]["plain-jax"]
    print(f"axplug/plain-jax step-time ratio: {ratio:.3f}")
    # XLA's FLOPs leave out a cuDNN kernel's work: MFU by the model's FLOPs (6 x params per
    # token + attention, the count `axplug aot` and the trainer's `mfu` use) as well.
    from axplug.trainer import model_flops_per_step

    flops = model_flops_per_step(cfg)
    for side, seconds in result["median"].items():
        print(
            f"{side:10} model-FLOPs MFU {flops / seconds / spec.peak_bf16_flops:6.1%} "
            f"({flops / 1e12:.2f} TFLOP/step)"
        )
    ours, plain = result["opcodes"]["axplug"], result["opcodes"]["plain-jax"]
    diff = sorted((ours[k] - plain[k], k) for k in ours | plain if ours[k] != plain[k])
    print(
        "compiled HLO opcodes, axplug minus plain-jax:", ", ".join(f"{k} {d:+d}" for d, k in diff)
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
