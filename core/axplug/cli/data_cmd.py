"""`axplug data verify DIR`: read every shard of a prepared data directory and check it."""

from __future__ import annotations

import argparse
from typing import Any

from axplug.api import add_command

__all__ = ["add_parser", "run"]

EPILOG = """\
examples:
  axplug data verify data/books                   every shard against meta.json
  axplug data verify data/books --vocab-size 32000   and every id below a model's vocabulary

`train` checks what is cheap when it opens a data directory (each shard's size against
meta.json and its docs.npy; the largest ids meta.json records, and each shard's first and
last token, against its vocab_size) and the ids of each batch it reads; `verify` reads
every token: a shard changed after prepare-data (its largest id no longer the recorded
one) or an id outside the vocabulary is one error line naming the shard. Exit 0 with a
summary line, or 2 and one error line (1: a file that cannot be read).
"""


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    parser = add_command(
        subparsers,
        "data",
        run,
        help="verify a prepared data directory (every shard read and checked)",
        description="Check a data directory written by `axplug prepare-data`.",
        epilog=EPILOG,
    )
    actions = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    verify = actions.add_parser(
        "verify",
        help="read every shard: sizes, document offsets, token ids vs meta.json",
        description="Read every shard of a data directory and check it against meta.json.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    verify.add_argument("directory", metavar="DIR", help="the data directory")
    verify.add_argument(
        "--vocab-size",
        type=int,
        metavar="N",
        help="also refuse ids >= N (a model's vocabulary; default: meta.json's vocab_size)",
    )
    return parser


def run(args: argparse.Namespace) -> int:
    from axplug.config import UsageError
    from axplug.input.data_dir import verify

    if args.vocab_size is not None and args.vocab_size < 1:
        raise UsageError(f"--vocab-size must be >= 1, got {args.vocab_size}")
    summary = verify(args.directory, vocab_size=args.vocab_size)
    bound = min(summary["vocab_size"], args.vocab_size or summary["vocab_size"])
    print(
        f"{args.directory}: ok, {summary['shards']} shard(s), {summary['documents']:,} documents, "
        f"{summary['tokens']:,} {summary['dtype']} tokens, largest id "
        f"{summary['max_token_id']} < {bound:,}"
    )
    return 0
