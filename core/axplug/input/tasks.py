"""Where `prepare_data` writes, and preparation split into tasks (`--num-tasks N --task-index I`).

Chunk `c` of the sources (`docs_per_shard` documents in source order) is shard `shard_{c}`
whichever process tokenizes it, so N tasks that each take every N-th chunk write exactly the
shards one process would. Each task ends by recording its shards in
`tasks/task_IIIII-of-NNNNN.json`; whichever task finds all N records (or `prepare-data
--merge`) checks they agree and cover every chunk once, and writes meta.json: the same file a
single process writes. An output URL is prepared in a local staging directory and uploaded a
shard at a time (an object appears whole), meta.json last, so a reader that trusts meta.json
never sees a partial dataset.
"""

from __future__ import annotations

import hashlib
import json
import os
import pathlib
import shutil

from axplug.config import ConfigError, UsageError
from axplug.input.remote import RemotePath, data_path, is_url
from axplug.paths import CACHE, cache_path

__all__ = ["TaskOutput", "check_task", "data_meta", "finish_task", "merge_tasks", "TASKS_DIR"]

TASKS_DIR = "tasks"
SHARD_FIELDS = ("name", "tokens", "documents", "max_token_id")  # a shard's record in meta.json
_SHARD_SUFFIXES = (".bin", ".docs.npy", ".mask.bin")


def _staging_root() -> str:
    """Where a bucket output's shards are made before upload (`$AXPLUG_PREPARE_STAGING`)."""
    return os.environ.get("AXPLUG_PREPARE_STAGING") or cache_path(f"{CACHE}/prepare")


def check_task(num_tasks: int, task_index: int) -> None:
    """Refuses a task index outside [0, num_tasks)."""
    if num_tasks < 1:
        raise UsageError(f"prepare-data: --num-tasks must be >= 1, got {num_tasks}")
    if not 0 <= task_index < num_tasks:
        raise UsageError(
            f"prepare-data: --task-index {task_index} is not in [0, --num-tasks {num_tasks})"
        )


def _task_name(index: int, count: int) -> str:
    return f"task_{index:05d}-of-{count:05d}.json"


class TaskOutput:
    """The data directory being written: `local` (where shards are made) and, for a URL
    output, the `remote` directory each finished file is uploaded to."""

    def __init__(self, local: pathlib.Path, remote: RemotePath | None):
        self.local, self.remote = local, remote

    @classmethod
    def open(cls, output, staging=None, storage_options: dict | None = None) -> TaskOutput:
        if not is_url(output):
            return cls(pathlib.Path(os.fspath(output)), None)
        remote = data_path(output, storage_options)
        remote.storage.check(remote.url)  # the server, bucket and credentials, before work
        if staging is None:
            digest = hashlib.sha256(remote.url.encode()).hexdigest()[:16]
            staging = pathlib.Path(_staging_root()) / digest
        return cls(pathlib.Path(staging), remote)

    @property
    def where(self):
        return self.local if self.remote is None else self.remote

    def publish(self, name: str) -> None:
        """Uploads the local file `name` (nothing to do for a local output)."""
        if self.remote is not None:
            self.remote.storage.put_file(self.local / name, (self.remote / name).url)

    def publish_shard(self, name: str) -> None:
        """Uploads a finished shard's files, its token file last."""
        for suffix in reversed(_SHARD_SUFFIXES):
            if (self.local / f"{name}{suffix}").exists():
                self.publish(f"{name}{suffix}")

    def write_text(self, name: str, text: str) -> None:
        from axplug.files import write_text

        write_text(self.local / name, text)
        self.publish(name)

    def read_text(self, name: str) -> str:
        return (self.where / name).read_text()

    def listdir(self, name: str) -> list[str]:
        if self.remote is None:
            path = self.local / name
            return sorted(p.name for p in path.iterdir()) if path.is_dir() else []
        return self.remote.storage.listdir((self.remote / name).url)

    def done(self) -> None:
        """Removes the staging directory of an uploaded output."""
        if self.remote is not None:
            shutil.rmtree(self.local, ignore_errors=True)


def data_meta(base: dict, records: list[dict]) -> dict:
    """meta.json: `base` with the shards' records and totals before its `settings`."""
    meta = {}
    for key, value in base.items():
        if key == "settings":
            meta["num_tokens"] = sum(r["tokens"] for r in records)
            meta["num_documents"] = sum(r["documents"] for r in records)
            meta["shards"] = [{k: r[k] for k in SHARD_FIELDS} for r in records]
        meta[key] = value
    return meta


def finish_task(target: TaskOutput, base: dict, records: list[dict], chunks: int,
                num_tasks: int, task_index: int) -> dict | None:  # fmt: skip
    """Records this task's shards; merges when every task has. Returns meta.json or None."""
    record = {"task": task_index, "num_tasks": num_tasks, "chunks": chunks, "base": base,
              "shards": [{k: r[k] for k in SHARD_FIELDS} for r in records]}  # fmt: skip
    (target.local / TASKS_DIR).mkdir(exist_ok=True)
    target.write_text(f"{TASKS_DIR}/{_task_name(task_index, num_tasks)}",
                      json.dumps(record, indent=1) + "\n")  # fmt: skip
    target.done()
    names = set(target.listdir(TASKS_DIR))
    if not all(_task_name(i, num_tasks) in names for i in range(num_tasks)):
        return None
    return merge_tasks(target)


def merge_tasks(target: TaskOutput) -> dict:
    """Writes meta.json from every task's record, after checking they make one dataset."""
    where = target.where / TASKS_DIR
    names = [n for n in target.listdir(TASKS_DIR) if n.startswith("task_")]
    if not names:
        raise ConfigError(
            f"prepare-data --merge: {where} holds no task records; run the tasks first "
            "(prepare-data ... --num-tasks N --task-index I)"
        )
    tasks = [json.loads(target.read_text(f"{TASKS_DIR}/{n}")) for n in names]
    count = tasks[0]["num_tasks"]
    first = tasks[0]
    for task in tasks:
        if (
            task["num_tasks"] != count
            or task["base"] != first["base"]
            or (task["chunks"] != first["chunks"])
        ):
            raise ConfigError(
                f"prepare-data --merge: {where}/{_task_name(task['task'], task['num_tasks'])} "
                f"was prepared with other sources, settings or --num-tasks than "
                f"{_task_name(first['task'], count)}; rerun every task with the same arguments"
            )
    missing = sorted(set(range(count)) - {t["task"] for t in tasks})
    if missing:
        raise ConfigError(
            f"prepare-data --merge: task(s) {', '.join(map(str, missing))} of {count} have "
            f"not finished (no record in {where}); run them, then merge"
        )
    shards = sorted((s for t in tasks for s in t["shards"]), key=lambda s: s["name"])
    expected = [f"shard_{i:05d}" for i in range(first["chunks"])]
    if [s["name"] for s in shards] != expected:
        raise ConfigError(
            f"prepare-data --merge: the tasks' shards in {where} are not shard_00000.. "
            f"shard_{first['chunks'] - 1:05d} once each; rerun the tasks with the same arguments"
        )
    meta = data_meta(first["base"], shards)
    target.write_text("meta.json", json.dumps(meta, indent=1) + "\n")
    target.done()
    return meta
