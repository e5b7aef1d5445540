"""`axplug dpo-reference`: store the reference model's log-probabilities with preference data."""

from __future__ import annotations

import argparse
from typing import Any

from axplug.api import add_command

__all__ = ["add_parser", "run"]

EPILOG = """\
examples:
  axplug dpo-reference --checkpoint runs/sft data/prefs
  axplug dpo-reference --checkpoint runs/base --step 1000 data/prefs

The reference of DPO and IPO is the model training starts from (the run or import given to
`train --from`; with --modifier lora, that same base: the adapters start at zero). Its
log-probability of every token is computed once here and stored beside the shards
(shard_NNNNN.reference_logps.bin), so training holds no second copy of the weights; meta.json
records the checkpoint and step. Running it again replaces them.
"""


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    parser = add_command(
        subparsers,
        "dpo-reference",
        run,
        help="store a reference model's log-probabilities with preference data",
        description="Compute the reference model's log-probabilities of preference data.",
        epilog=EPILOG,
    )
    parser.add_argument("data_dir", metavar="DATA_DIR", help="from axplug prepare-preferences")
    parser.add_argument("--checkpoint", required=True, metavar="RUN", help="the reference run")
    parser.add_argument("--step", type=int, help="checkpoint step (default: the latest)")
    return parser


def run(args: argparse.Namespace) -> int:
    from axplug.api.run import load_checkpoint
    from axplug_dpo.reference import store_reference

    loaded = load_checkpoint(args.checkpoint, step=args.step)
    entry = store_reference(args.data_dir, loaded)
    print(f"wrote reference log-probabilities of step {entry['step']} of {entry['checkpoint']} "
          f"into {args.data_dir}")  # fmt: skip
    return 0
