"""`axplug prepare-data`: tokenize text, JSONL, Parquet or a saved dataset into token shards."""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

from axplug.api import add_command

__all__ = ["add_parser", "run"]

EPILOG = """\
examples:
  axplug prepare-data books/*.txt --tokenizer tokenizer.json --output data/books
  axplug prepare-data web.jsonl --field content --tokenizer llama/tokenizer.model \\
      --output data/web --workers 8
  axplug prepare-data shard-*.parquet --tokenizer gpt2.tiktoken --output data/pq
  axplug prepare-data web.jsonl --tokenizer tok.json --output s3://bucket/data/web
  axplug prepare-data shard-*.jsonl --tokenizer tok.json --output /shared/web \
      --num-tasks 4 --task-index 0        # ... and 1, 2, 3 on other machines
  axplug data verify data/books
  axplug train --preset gpt-tiny --input token_file:path=data/books --output-dir runs/books

Sources: `.jsonl` (one JSON object per line; --field names the text), `.parquet` (--field
names the column), a directory saved by Hugging Face `datasets` (`save_to_disk`), or text
(one document per file, or per --text-unit paragraph/line). Each document gets the
tokenizer's EOS appended (--no-eos to leave it out). The output holds token shards,
meta.json (written last; it records each shard's token count and largest id) and a copy
of the tokenizer; a killed run rerun with the same arguments tokenizes only what is
missing. The tokenizer and the arguments are checked before anything is written. The
tokenizer is a tokenizer.json, a SentencePiece .model, a .tiktoken file, a directory with
one of them, or `bytes` (pip install 'axplug[tokenizers]'). `axplug data verify DIR` reads
every shard back and checks it against meta.json.

--output may be a storage URL (s3://, gs://: with the object-store plugin of
docs/your-data.md and the same AWS_*/GCS settings as checkpoints): shards are made in
--staging (default under ~/.cache/axplug/prepare) and uploaded as each is done, meta.json last.
--num-tasks N --task-index I splits the work over N processes or machines: task I tokenizes
every N-th chunk of --docs-per-shard documents, each task writing its own shards into the
same --output; the last task to finish writes meta.json (or run `--merge --output DIR`). The
result is the dataset one process makes, byte for byte. `axplug launch --print slurm-array`
or `k8s-indexed` renders the array job.
"""


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    parser = add_command(
        subparsers,
        "prepare-data",
        run,
        help="tokenize text/JSONL/Parquet into token shards for --input token_file",
        description="Tokenize documents into a data directory that `--input token_file:path=DIR` "
        "trains on.",
        epilog=EPILOG,
    )
    parser.add_argument("files", nargs="*", metavar="FILE", help="the sources, in order")
    parser.add_argument("--tokenizer", metavar="PATH", help="tokenizer file or dir (required)")
    parser.add_argument("--output", required=True, metavar="DIR", help="the data directory or URL")
    parser.add_argument("--field", default="text", help="JSONL field / Parquet column (text)")
    parser.add_argument(
        "--text-unit",
        choices=("file", "paragraph", "line"),
        default="file",
        help="what a document is in a text file (default: the whole file)",
    )
    parser.add_argument(
        "--docs-per-shard", type=int, default=10_000, help="documents per shard (10000)"
    )
    parser.add_argument("--workers", type=int, help="tokenizing processes (default: CPUs)")
    parser.add_argument("--no-eos", action="store_true", help="do not append EOS to documents")
    parser.add_argument("--num-tasks", type=int, default=1, metavar="N",
                        help="split the work over N tasks (default 1)")  # fmt: skip
    parser.add_argument("--task-index", type=int, default=0, metavar="I",
                        help="this task's index in [0, N) (default 0)")  # fmt: skip
    parser.add_argument("--merge", action="store_true",
                        help="write meta.json from the tasks' records, then stop")  # fmt: skip
    parser.add_argument("--staging", metavar="DIR",
                        help="where shards for a URL --output are made")  # fmt: skip
    return parser


def run(args: argparse.Namespace) -> int:
    from axplug.config import UsageError

    for flag, value in (("--workers", args.workers), ("--docs-per-shard", args.docs_per_shard)):
        if value is not None and value < 1:
            raise UsageError(f"{flag} must be >= 1, got {value}")
    from rich.console import Console
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    from axplug.input.prepare import prepare_data

    if args.merge:
        return _merge(args)
    if not args.files or not args.tokenizer:
        raise UsageError("prepare-data needs FILE... and --tokenizer (or --merge --output DIR)")
    console = Console(stderr=True)
    totals = {"docs": 0, "tokens": 0}
    start = time.perf_counter()
    with Progress(
        SpinnerColumn(),
        TextColumn("{task.description}"),
        TimeElapsedColumn(),
        console=console,
        disable=not sys.stderr.isatty(),
    ) as progress:
        task = progress.add_task("tokenizing", total=None)

        def on_shard(record: dict) -> None:
            totals["docs"] += record["documents"]
            totals["tokens"] += record["tokens"]
            rate = totals["tokens"] / max(time.perf_counter() - start, 1e-9)
            progress.update(
                task,
                description=f"{record['name']}: {totals['docs']:,} documents, "
                f"{totals['tokens']:,} tokens ({rate:,.0f} tokens/s)",
            )

        meta = prepare_data(
            args.files,
            tokenizer=args.tokenizer,
            output=args.output,
            field=args.field,
            text_unit=args.text_unit,
            docs_per_shard=args.docs_per_shard,
            workers=args.workers,
            append_eos=not args.no_eos,
            on_shard=on_shard,
            num_tasks=args.num_tasks,
            task_index=args.task_index,
            staging=args.staging,
        )
    seconds = time.perf_counter() - start
    if meta is None:
        print(
            f"task {args.task_index} of {args.num_tasks} done: {totals['docs']:,} documents, "
            f"{totals['tokens']:,} tokens written to {args.output}; meta.json comes when "
            "every task is done (or: axplug prepare-data --merge --output ...)"
        )
        return 0
    print(
        f"wrote {args.output}: {meta['num_documents']:,} documents, {meta['num_tokens']:,} "
        f"tokens in {len(meta['shards'])} shard(s), {meta['dtype']}, vocab "
        f"{meta['vocab_size']:,} ({meta['num_tokens'] / max(seconds, 1e-9):,.0f} tokens/s)"
    )
    return 0


def _merge(args: argparse.Namespace) -> int:
    from axplug.input.tasks import TaskOutput, merge_tasks

    meta = merge_tasks(TaskOutput.open(args.output, args.staging))
    print(
        f"merged {args.output}: {meta['num_documents']:,} documents, {meta['num_tokens']:,} "
        f"tokens in {len(meta['shards'])} shard(s)"
    )
    return 0
