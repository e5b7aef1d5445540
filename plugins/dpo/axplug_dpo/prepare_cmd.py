"""`axplug prepare-preferences`: tokenize preference pairs (prompt, chosen, rejected)."""

from __future__ import annotations

import argparse
from typing import Any

__all__ = ["add_parser", "run"]

EPILOG = """\
examples:
  axplug prepare-preferences pairs.jsonl --tokenizer runs/sft --output data/prefs
  axplug prepare-preferences pairs.jsonl --tokenizer tok.json --plain --output data/prefs
  axplug dpo-reference --checkpoint runs/sft data/prefs
  axplug train --from runs/sft --modifier dpo:beta=0.1 --input preferences:path=data/prefs \\
      --output-dir runs/dpo

Each JSONL line is {"prompt": ..., "chosen": ..., "rejected": ...}: the prompt a string (one
user turn) or a list of {role, content} messages, each response a string (or one assistant
message). A pair is two documents, chosen then rejected, rendered with the model's chat
template like `prepare-chat` (--plain: prompt text then response and EOS), the loss mask on
the response. `dpo-reference` then stores the starting model's log-probabilities beside them.
"""


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "prepare-preferences",
        help="tokenize preference pairs (prompt, chosen, rejected) for DPO",
        description="Tokenize preference pairs into a data directory for --modifier dpo.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("files", nargs="+", metavar="FILE", help="JSONL files, in order")
    parser.add_argument("--tokenizer", required=True, metavar="PATH", help="tokenizer file or dir")
    parser.add_argument("--output", required=True, metavar="DIR", help="the data directory")
    parser.add_argument("--chat-template", metavar="FILE", help="a Jinja chat template file")
    parser.add_argument("--plain", action="store_true", help="no chat template: prompt + reply")
    parser.add_argument("--docs-per-shard", type=int, default=10_000, help="pairs per shard")
    parser.add_argument("--workers", type=int, help="tokenizing processes (default: CPUs)")
    parser.set_defaults(run=run)
    return parser


def run(args: argparse.Namespace) -> int:
    from axplug_chat.prepare_cmd import prepare_records

    from axplug.config import UsageError
    from axplug_dpo.data import PreferenceEncoder

    if args.plain and args.chat_template:
        raise UsageError("--plain and --chat-template: give one")
    for flag, value in (("--workers", args.workers), ("--docs-per-shard", args.docs_per_shard)):
        if value is not None and value < 1:
            raise UsageError(f"{flag} must be >= 1, got {value}")
    meta = prepare_records(
        args.files,
        tokenizer=args.tokenizer,
        output=args.output,
        encoder_for=lambda t: PreferenceEncoder(None if args.plain else t),
        docs_per_shard=args.docs_per_shard,
        workers=args.workers,
        chat_template=args.chat_template,
    )
    print(
        f"wrote {args.output}: {meta['num_documents'] // 2:,} pairs, {meta['num_tokens']:,} "
        "tokens; next: axplug dpo-reference --checkpoint BASE " + args.output
    )
    return 0
