"""`axplug export-lora`: a run's LoRA adapters as a PEFT adapter directory."""

from __future__ import annotations

import argparse
from typing import Any

from axplug.api import add_command

__all__ = ["add_parser", "run"]

EPILOG = """\
examples:
  axplug export-lora runs/chat-lora --output adapters/chat
  axplug export-lora runs/chat-lora --output adapters/chat --step 200 --force

Writes adapter_model.safetensors and adapter_config.json (PEFT's LoRA format), loaded over
the base model by PEFT (`PeftModel.from_pretrained(base, DIR)`), transformers and vLLM
(`--enable-lora`). The base is the model the run was tuned from (`axplug export-hf` of the
import or run given to `train --from`). `axplug export-hf` on the LoRA run itself writes the
merged model instead. Each adapted layer must be a plain nn.Linear of the Hugging Face model
(q/k/v/o and the MLP projections of LLaMA-style families; a fused qkv is refused). DIR is
written whole or not at all, like export-hf's.
"""


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    parser = add_command(
        subparsers,
        "export-lora",
        run,
        help="write a LoRA run's adapters as a PEFT adapter directory",
        description="Write the LoRA adapters of a run as a PEFT adapter directory.",
        epilog=EPILOG,
    )
    parser.add_argument("run_dir", metavar="RUN_DIR", help="a run trained with --modifier lora")
    parser.add_argument("--output", required=True, metavar="DIR", help="where to write")
    parser.add_argument("--step", type=int, help="checkpoint step (default: the latest)")
    parser.add_argument("--force", action="store_true", help="replace DIR when not empty")
    return parser


def run(args: argparse.Namespace) -> int:
    from axplug_lora.peft import peft_adapter

    config = peft_adapter(args.run_dir, args.output, step=args.step, force=args.force)
    print(
        f"wrote {args.output}: a PEFT LoRA adapter (rank {config['r']}, alpha "
        f"{config['lora_alpha']}) on {', '.join(config['target_modules'])} of a "
        f"{config['architecture']}"
    )
    return 0
