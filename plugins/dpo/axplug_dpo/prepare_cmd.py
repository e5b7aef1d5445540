"""`axplug prepare-preferences`: tokenize preference pairs (prompt, chosen, rejected)."""

from __future__ import annotations

import argparse
from typing import Any

from axplug.api import add_command

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
    parser = add_command(
        subparsers,
        "prepare-preferences",
        run,
        help="tokenize preference pairs (prompt, chosen, rejected) for DPO",
        description="Tokenize preference pairs into a data directory for --modifier dpo.",
        epilog=EPILOG,
    )
    from axplug_chat.prepare_cmd import add_record_arguments

    add_record_arguments(parser)
    parser.add_argument("--plain", action="store_true", help="no chat template: prompt + reply")
    return parser


def run(args: argparse.Namespace) -> int:
    from axplug_chat.prepare_cmd import prepare_records

    from axplug.api.config import UsageError
    from axplug_dpo.data import PreferenceEncoder

    if args.plain and args.chat_template:
        raise UsageError("--plain and --chat-template: give one")
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
