"""`axplug import-hf`: a Hugging Face checkpoint -> an axplug run directory."""

from __future__ import annotations

import argparse
from typing import Any

from axplug.api import add_command
from axplug.api._commands import add_config_arguments

__all__ = ["add_parser", "run"]

EPILOG = """\
examples:
  axplug import-hf ~/models/TinyLlama-1.1B --output runs/tinyllama
  axplug import-hf ~/models/Mixtral-8x7B --output runs/mixtral \\
      --modifier scan_layers:remat_policy=full        scan the layer stack
  axplug import-hf DIR --output OUT --set model.compute_dtype=float32
  axplug import-hf DIR --output OUT --print-config    print the config only; nothing is written

DIR holds config.json and model.safetensors (or shards listed by model.safetensors.index.json).
Its architecture must be installed: `axplug list --kind architectures` shows them
(docs/model-families.md lists the first-party families and their plugins). Every
config.json field must be read by a layer of the model, or the import is refused naming it.
OUTPUT gets config.txt and checkpoints/step_00000000 in the trainer's layout (fresh optimizer
state), so `axplug train` on it fine-tunes and anything that loads a trained run loads it.

Everything is read and checked before anything is written: every tensor (float16, bfloat16,
float32 or float64 only, no NaN or inf) and the tokenizer files, loaded as `generate` loads
them. The tokenizer files and config.txt / config.json are written under temporary names and
renamed into place, and the checkpoint commits last: an import killed or out of disk space
leaves no complete step, and the same command run again cleans up after it and imports. An
OUTPUT that already holds a complete checkpoint is refused.
"""


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    parser = add_command(
        subparsers,
        "import-hf",
        run,
        help="import a Hugging Face checkpoint (config.json + safetensors)",
        description="Convert a Hugging Face checkpoint directory into an axplug config and\n"
        "checkpoint. The config is the architecture's (its layers set from config.json),\n"
        "then each --modifier, then each --set.",
        epilog=EPILOG,
    )
    parser.add_argument("directory", metavar="DIR", help="the Hugging Face checkpoint directory")
    parser.add_argument("--output", required=True, help="the axplug run directory to write")
    add_config_arguments(
        parser, modifier_help="apply a registered modifier after the import's own; repeatable"
    )
    parser.add_argument(
        "--print-config", action="store_true", help="print the config and exit, writing nothing"
    )
    return parser


def run(args: argparse.Namespace) -> int:
    import logging

    logging.getLogger("absl").setLevel(logging.WARNING)  # orbax logs every file it writes
    from axplug.interop.from_config import read_hf_config

    hf = read_hf_config(args.directory)  # refused here, before jax, when not installed
    if args.print_config:
        from axplug.interop import hf_trainer_config

        cfg = hf_trainer_config(
            hf, output_dir=args.output, modifiers=args.modifier, overrides=args.overrides
        )
        print(cfg.debug_string())
        return 0
    from axplug.interop import import_hf

    result = import_hf(
        args.directory, args.output, modifiers=args.modifier, overrides=args.overrides
    )
    print(
        f"imported {result.architecture} ({result.num_params:,} parameters) from "
        f"{args.directory}\n  modifiers: {' '.join(result.modifiers) or 'none'}\n"
        f"  checkpoint: {result.checkpoint}\n  config: {args.output.rstrip('/')}/config.txt"
    )
    return 0
