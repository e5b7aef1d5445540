"""`axplug checkpoints ls|rm|verify URL`: the steps of a checkpoint directory, local or in a
bucket."""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

from axplug.api import add_command

__all__ = ["add_parser", "run", "format_size"]

EPILOG = """\
examples:
  axplug checkpoints ls runs/tiny                 a run dir (its checkpoints/) or the dir itself
  axplug checkpoints ls s3://bucket/run --json
  axplug checkpoints rm gs://bucket/run --step 40 delete one step, completion marker first
  axplug checkpoints rm runs/tiny --step 300 --force   the latest (or only) complete step too
  axplug checkpoints verify runs/tiny             read each complete step, check its checksums

States: complete (restorable), incomplete (no completion marker: a save cut short on an
object store, or a deleted step), partial (orbax's temporary directory: a save in progress,
or one that was killed). `rm` refuses the latest or only complete step without --force: a
resume would go back to an earlier step, or start over.

Storage settings (endpoint, region, retries) come from the standard environment
(AWS_ENDPOINT_URL, AWS_REGION, STORAGE_EMULATOR_HOST, ...) or --storage-option KEY=VALUE.
"""


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    parser = add_command(
        subparsers,
        "checkpoints",
        run,
        help="list, delete or verify the checkpoint steps of a run (local or s3://, gs://)",
        description="List, delete or verify checkpoint steps, complete or not, anywhere a "
        "storage backend is installed for.",
        epilog=EPILOG,
    )
    actions = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    ls = actions.add_parser("ls", help="steps with completeness, size and time")
    ls.add_argument("url", help="checkpoint directory, or a run dir holding checkpoints/")
    ls.add_argument("--json", action="store_true", help="one JSON object per step")
    rm = actions.add_parser("rm", help="delete one step (its completion marker first)")
    rm.add_argument("url", help="checkpoint directory, or a run dir holding checkpoints/")
    rm.add_argument("--step", type=int, required=True, help="the step to delete")
    rm.add_argument(
        "--force",
        action="store_true",
        help="delete it even if it is the latest or only complete step",
    )
    verify = actions.add_parser(
        "verify", help="read every complete step (or --step) and check its leaf checksums"
    )
    verify.add_argument("url", help="checkpoint directory, or a run dir holding checkpoints/")
    verify.add_argument("--step", type=int, default=None, help="only this step")
    for sub in (ls, rm, verify):
        sub.add_argument(
            "--storage-option",
            action="append",
            default=[],
            metavar="KEY=VALUE",
            help="a keyword argument of the storage backend (e.g. endpoint=http://...)",
        )
    return parser


def format_size(size: int | None) -> str:
    """`12.3 MB`-style size; `?` when unknown."""
    if size is None:
        return "?"
    value = float(size)
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if value < 1000 or unit == "TB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1000
    raise AssertionError("unreachable")


def _options(pairs: list[str]) -> dict[str, Any]:
    from axplug.config import UsageError

    options: dict[str, Any] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise UsageError(f"--storage-option {pair!r}: expected KEY=VALUE")
        try:
            options[key] = json.loads(value)
        except json.JSONDecodeError:
            options[key] = value
    return options


def _verify(args: argparse.Namespace, directory: str) -> int:
    from axplug.api._errors import AxplugError
    from axplug.checkpoint import CheckpointCorruptError, Checkpointer

    cfg = Checkpointer.default_config().set(
        directory=directory, storage_options=_options(args.storage_option) or None
    )
    bad = 0
    with cfg.instantiate() as checkpointer:
        steps = checkpointer.all_steps() if args.step is None else [args.step]
        if not steps:
            raise AxplugError(f"no complete checkpoint steps in {directory}")
        for step in steps:
            try:
                leaves = checkpointer.verify(step)
            except CheckpointCorruptError as exc:
                bad += 1
                print(f"step {step}: CORRUPT: {exc}")
                continue
            if leaves is None:
                print(f"step {step}: not verifiable (saved without checksums)")
            else:
                print(f"step {step}: ok ({leaves} leaves match their checksums)")
    return 1 if bad else 0


def _rm(storage: Any, directory: str, step: int, *, force: bool) -> int:
    """Deletes `step` (its directory and any partial save of it); refuses the latest or only
    complete step unless `force`."""
    from axplug.checkpoint import CheckpointNotFoundError, delete_step, list_steps
    from axplug.config import UsageError

    infos = list_steps(storage, directory)
    own = [info for info in infos if info.step == step]
    if not own:
        raise CheckpointNotFoundError(f"step {step} does not exist in {directory}")
    complete = [info.step for info in infos if info.complete]
    if not force and complete and complete[-1] == step:
        if len(complete) == 1:
            raise UsageError(
                f"step {step} is the only complete checkpoint in {directory}: deleting it "
                "loses what the run trained; pass --force to delete it anyway"
            )
        raise UsageError(
            f"step {step} is the latest complete checkpoint in {directory}: a resume would go "
            f"back to step {complete[-2]}; pass --force to delete it anyway"
        )
    for info in own:
        if info.partial:
            storage.delete(info.url)
        else:
            delete_step(storage, directory, step)
    print(f"deleted step {step} from {directory}")
    return 0


def run(args: argparse.Namespace) -> int:
    from axplug.api._errors import AxplugError
    from axplug.checkpoint import list_steps, resolve_checkpoint_dir, storage_for

    storage = storage_for(args.url, _options(args.storage_option))
    directory = resolve_checkpoint_dir(storage, args.url)
    if args.action == "rm":
        return _rm(storage, directory, args.step, force=args.force)
    if args.action == "verify":
        return _verify(args, directory)
    infos = list_steps(storage, directory, sizes=True)
    if not infos and not storage.exists(directory):
        raise AxplugError(f"{args.url}: no such checkpoint directory")
    if args.json:
        for info in infos:
            print(json.dumps({"step": info.step, "complete": info.complete,
                              "state": info.state, "size_bytes": info.size_bytes,
                              "mtime": info.mtime, "url": info.url}))  # fmt: skip
        return 0
    if not infos:
        print(f"no checkpoint steps in {directory}")
        return 0
    print(f"{directory}")
    print(f"{'step':>10}  {'state':<10}  {'size':>10}  time (UTC)")
    for info in infos:
        when = (
            time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(info.mtime))
            if info.mtime is not None
            else "?"
        )
        print(f"{info.step:>10}  {info.state:<10}  {format_size(info.size_bytes):>10}  {when}")
    return 0
