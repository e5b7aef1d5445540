"""What command plugins share: the options of commands that load a model from a run."""

from __future__ import annotations

import argparse

__all__ = ["add_checkpoint_arguments"]


def add_checkpoint_arguments(parser: argparse.ArgumentParser, *, required: bool = True) -> None:
    """--checkpoint (`required` or not), --step, --tokenizer, --modifier and
    --merge-adapters, as `load_checkpoint` and `find_tokenizer` take them."""
    parser.add_argument("--checkpoint", required=required, metavar="DIR", help="run directory")
    parser.add_argument("--step", type=int, help="checkpoint step (default: the latest)")
    parser.add_argument(
        "--tokenizer",
        metavar="PATH",
        help="tokenizer file or directory, or `bytes` (default: the run's own)",
    )
    parser.add_argument(
        "--modifier",
        action="append",
        default=[],
        metavar="NAME[:k=v,...]",
        help="apply to the loaded config, e.g. paged_kv_cache (repeatable)",
    )
    parser.add_argument(
        "--merge-adapters",
        action="store_true",
        help="fold adapters (LoRA) into their weights before running: no adapter matmuls",
    )
