"""`axplug export-hf`: a run's model as a Hugging Face checkpoint directory."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from axplug.api import add_command

__all__ = ["add_parser", "run"]

EPILOG = """\
examples:
  axplug export-hf runs/tuned --output hf/tuned
  axplug export-hf runs/tuned --output hf/tuned-step200 --step 200
  axplug export-hf runs/tuned --output hf/tuned --force     replace an earlier export

The model must be one an installed architecture builds (`axplug list --kind architectures`):
an `axplug import-hf` import and its fine-tunes export as their own architecture, a preset's
run as the first architecture that expresses it (a LLaMA-style run: LlamaForCausalLM). What no
architecture expresses (ALiBi, interleaved RoPE, a capacity-limited router) is refused by its
config path. The output holds config.json (the layers' fields over the imported model's own),
sharded safetensors with their index, and the run's tokenizer files. `axplug import-hf` on
it gives back the same parameters.

The export is written into a temporary directory beside DIR (.NAME.tmp-PID) and renamed to
DIR once complete: DIR is never partial, and an export killed or out of disk space leaves no
DIR (run it again as is; the temporary directories of dead exports are deleted). DIR must be
new or empty; --force replaces a non-empty one whole (no old shard or index is left beside
the new files), the old directory deleted only once the new one is in place.
"""


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    parser = add_command(
        subparsers,
        "export-hf",
        run,
        help="write a run's model as a Hugging Face checkpoint",
        description="Write a run's model as a Hugging Face checkpoint directory.",
        epilog=EPILOG,
    )
    parser.add_argument("run_dir", metavar="RUN_DIR", help="a run (or import) directory")
    parser.add_argument("--output", required=True, metavar="DIR", help="where to write")
    parser.add_argument("--step", type=int, help="checkpoint step (default: the latest)")
    parser.add_argument(
        "--force", action="store_true", help="replace DIR when it is not empty (the whole DIR)"
    )
    return parser


def run(args: argparse.Namespace) -> int:
    from axplug.interop.hf_export import export_hf

    raw = export_hf(args.run_dir, args.output, step=args.step, force=args.force)
    import os

    shards = sorted(f for f in os.listdir(args.output) if f.endswith(".safetensors"))
    print(
        f"wrote {args.output}: {raw['architectures'][0]}, config.json and "
        f"{len(shards)} safetensors file(s)",
        file=sys.stdout,
    )
    return 0
