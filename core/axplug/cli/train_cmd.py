"""`axplug train`: build a trainer from a preset, modifiers and overrides, then train or resume."""

from __future__ import annotations

import argparse
import sys
from typing import Any

__all__ = ["add_parser", "run", "build_config"]

EPILOG = """\
examples:
  axplug train --preset llama-tiny --output-dir runs/tiny
      train the tiny LLaMA on the bundled corpus; rerun the same command to resume
  axplug train --preset gpt-tiny --output-dir runs/gpt --max-steps 50 \
      --set learner.learning_rate=1e-3
  axplug train --preset llama-tiny --modifier mesh:fsdp=-1 --output-dir runs/fsdp
      FSDP over every device (with XLA_FLAGS=--xla_force_host_platform_device_count=8 on CPU)
  axplug train --preset llama-tiny --modifier scan_layers:remat_policy=full --output-dir runs/scan

The effective config is written to OUTPUT_DIR/config.txt before training; metrics go to
OUTPUT_DIR/metrics.jsonl and OUTPUT_DIR/tensorboard/, checkpoints to OUTPUT_DIR/checkpoints/.
A run pointed at an output dir with checkpoints resumes from the latest complete one.
"""


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "train",
        help="train a model from a preset (resumes from OUTPUT_DIR)",
        description="Train a model. The config is the preset's (with its own modifiers), then\n"
        "the mesh rule's modifiers, then each --modifier in order, then each --set override.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--preset", required=True, help="preset name (see `axplug list --kind presets`)"
    )
    parser.add_argument(
        "--modifier",
        action="append",
        default=[],
        metavar="NAME[:k=v,...]",
        help="apply a registered modifier; repeatable",
    )
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        dest="overrides",
        metavar="PATH=VALUE",
        help="override one config field; repeatable",
    )
    parser.add_argument(
        "--mesh-rule",
        default="auto",
        metavar="auto|SELECTOR",
        help="mesh rule: auto-detect the accelerator, a selector such as "
        "tpu-v5p-512, or 'none' (default: auto)",
    )
    parser.add_argument(
        "--output-dir", required=True, help="where config, metrics and checkpoints go"
    )
    parser.add_argument("--max-steps", type=int, help="train until this many steps in total")
    parser.add_argument("--checkpoint-every", type=int, help="save every N steps")
    parser.add_argument("--seed", type=int, help="seed of initialization, data and dropout")
    parser.add_argument(
        "--print-config",
        action="store_true",
        help="print the effective config and exit without training",
    )
    parser.set_defaults(run=run)
    return parser


def build_config(args: argparse.Namespace):
    """The effective Trainer config for the parsed arguments."""
    from axplug.config import apply_overrides
    from axplug.mesh_rules import select_mesh_rule
    from axplug.modifiers import make_modifier
    from axplug.presets import preset_config

    overrides = [f"output_dir={args.output_dir!r}"]
    for flag, field in (
        ("max_steps", "max_steps"),
        ("checkpoint_every", "checkpoint_every"),
        ("seed", "seed"),
    ):
        if getattr(args, flag) is not None:
            overrides.append(f"{field}={getattr(args, flag)}")
    cfg = preset_config(args.preset, overrides=overrides)
    if args.mesh_rule != "none":
        name, rule = select_mesh_rule(args.mesh_rule)
        cfg = rule.modifier()(cfg)
        print(f"mesh rule: {name}", file=sys.stderr)
    for spec in args.modifier:
        cfg = make_modifier(spec)(cfg)
    if args.seed is not None:
        cfg.input.seed = args.seed
    return apply_overrides(cfg, args.overrides)


def run(args: argparse.Namespace) -> int:
    from axplug.config import ConfigError
    from axplug.registry import ComponentNotFoundError

    try:
        cfg = build_config(args)
    except (ConfigError, ComponentNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.print_config:
        print(cfg.debug_string())
        return 0
    import logging

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("absl").setLevel(logging.WARNING)  # orbax logs every file it writes
    from axplug.trainer.run import train

    metrics = train(cfg)
    loss = f", loss {metrics['loss']:.4f}" if "loss" in metrics else ""
    print(f"done: step {metrics.get('step')}{loss}")
    return 0
