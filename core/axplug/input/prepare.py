"""`prepare_data`: text, JSONL, Parquet or a saved Hugging Face dataset -> token shards.

Documents are read in order from every source (`axplug.input.sources`) and grouped into chunks
of `docs_per_shard`; each chunk is tokenized by a worker process and written as one shard
(`write_shard`), so the output does not depend on the number of workers. A shard on disk is
finished (written, then renamed), so a rerun after a kill tokenizes only the missing chunks;
`progress.json` records the settings and refuses a rerun that would mix different ones.
`meta.json` comes last.

A `DocumentEncoder` (a plugin's: chat conversations, preference pairs) turns each source
record into token documents with a per-token loss mask, stored beside the shards.

The arguments, the sources' kinds and the tokenizer are checked before anything is written; a
source that turns out unreadable midway (a truncated JSONL line) removes the output directory
when this run created it, since the fixed source would not match its `progress.json`.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import pathlib
import shutil
from collections.abc import Callable, Iterator
from typing import Any, Protocol

from axplug.config import ConfigError, ConfigFileError, ConfigValueError, UsageError
from axplug.files import errors_naming, write_text
from axplug.input.data_dir import TOKEN_DIR_FORMAT, open_shard, write_shard
from axplug.input.sources import TEXT_UNITS, chunks, read_documents, source_kind
from axplug.input.tasks import TaskOutput, check_task, data_meta, finish_task
from axplug.tokenizer import Tokenizer, load_tokenizer

__all__ = ["prepare_data", "read_documents", "TEXT_UNITS", "DocumentEncoder"]

_worker: dict = {}


class DocumentEncoder(Protocol):
    """Turns one source record into token documents with loss masks (picklable: it runs in
    the tokenizing processes). `prepare_data(..., encoder=...)` reads `field` of each JSONL
    line (`"*"`: the whole object)."""

    field: str

    def settings(self) -> dict:
        """What makes its output differ (template, options): progress.json and meta.json."""

    def encode(self, tokenizer: Tokenizer, record: Any) -> list[tuple[list[int], list[int]]]:
        """(ids, mask) per document of `record`: mask 1 where the loss counts predicting the
        token; raises ValueError naming what is wrong with the record."""

    def meta(self) -> dict:
        """Entries added to meta.json (e.g. the chat template used)."""

    def files(self) -> dict[str, str]:
        """Text files written into the data directory (e.g. chat_template.jinja)."""


def _init_worker(tokenizer_path: str, directory: str, dtype: str, eos: int | None,
                 encoder: DocumentEncoder | None = None) -> None:  # fmt: skip
    _worker.update(
        tok=load_tokenizer(tokenizer_path),
        dir=pathlib.Path(directory),
        dtype=dtype,
        eos=eos,
        encoder=encoder,
    )


def _tokenize_chunk(job: tuple[int, list]) -> dict:
    index, texts = job
    name = f"shard_{index:05d}"
    encoder = _worker["encoder"]
    if encoder is None:
        tail = [] if _worker["eos"] is None else [_worker["eos"]]
        documents = [_worker["tok"].encode(text) + tail for text in texts]
        record = write_shard(_worker["dir"], name, documents, _worker["dtype"])
        return {**record, "bytes": sum(len(t.encode("utf-8")) for t in texts)}
    documents, masks = [], []
    for number, item in enumerate(texts):
        try:
            encoded = encoder.encode(_worker["tok"], item)
        except ValueError as e:
            raise ConfigError(f"record {number + 1} of {name}'s chunk: {e}") from None
        for ids, mask in encoded:
            documents.append(ids)
            masks.append(mask)
    record = write_shard(_worker["dir"], name, documents, _worker["dtype"], masks)
    return {**record, "bytes": 0}


def _settings(sources, tokenizer: Tokenizer, field, text_unit, docs_per_shard, eos) -> dict:
    digest = hashlib.sha256(tokenizer.source.read_bytes() if tokenizer.source else b"bytes")
    return {
        "sources": [
            {"path": str(s), "size": None}  # a data source's NAME:SPEC, as given
            if source_kind(s)
            else {"path": str(pathlib.Path(s).resolve()), "size": _size(pathlib.Path(s))}
            for s in sources
        ],
        "tokenizer_sha256": digest.hexdigest(),
        "field": field,
        "text_unit": text_unit,
        "docs_per_shard": docs_per_shard,
        "eos": eos,
    }


def _size(path: pathlib.Path) -> int:
    if path.is_dir():
        return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
    return path.stat().st_size if path.exists() else -1


def _check_output(out: pathlib.Path) -> None:
    """Refuses an output that is, or is inside, something other than a directory."""
    for path in (out, *out.parents):
        if path.exists():
            if not path.is_dir():
                raise UsageError(
                    f"prepare-data: --output {str(out)!r}: {str(path)!r} is a file, not a "
                    "directory; give a new directory (or the one a killed run left)"
                )
            return


def prepare_data(
    sources: list[str | os.PathLike],
    *,
    tokenizer: str | os.PathLike,
    output: str | os.PathLike,
    field: str = "text",
    text_unit: str = "file",
    docs_per_shard: int = 10_000,
    workers: int | None = None,
    append_eos: bool = True,
    on_shard: Callable[[dict], None] | None = None,
    encoder: DocumentEncoder | None = None,
    num_tasks: int = 1,
    task_index: int = 0,
    staging: str | os.PathLike | None = None,
    storage_options: dict | None = None,
) -> dict | None:
    """Tokenizes `sources` into the data directory `output`; returns its meta.json content
    (None: a task of several whose others are not all done yet).

    `on_shard(record)` is called as each shard is done (the CLI's progress bar). With an
    `encoder`, each record of `encoder.field` becomes its documents and loss masks.

    `num_tasks` > 1 makes this task `task_index` of that many (`axplug.input.tasks`): it
    tokenizes every `num_tasks`-th chunk and records them; the task that finds all others'
    records writes meta.json. An `output` URL (`s3://...`) is prepared in `staging` (a local
    directory; default under ~/.cache/axplug/prepare) and each shard uploaded as it is done,
    meta.json last."""
    if encoder is not None:
        field = encoder.field
    if docs_per_shard < 1:
        raise ConfigValueError(f"docs_per_shard must be >= 1, got {docs_per_shard}")
    if workers is not None and workers < 1:
        raise ConfigValueError(f"workers must be >= 1 (or None: one per CPU), got {workers}")
    if text_unit not in TEXT_UNITS:
        raise ConfigValueError(f"text unit {text_unit!r}: one of {TEXT_UNITS}")
    if not sources:
        raise ConfigError("prepare-data: no input files given")
    check_task(num_tasks, task_index)
    for source in sources:
        read_documents(source, field=field, text_unit=text_unit)  # exists, readable kind
    target = TaskOutput.open(output, staging, storage_options)
    out = target.local
    _check_output(out)
    tok = load_tokenizer(tokenizer)  # a file its library cannot read: one error naming it
    created = not out.exists()
    out.mkdir(parents=True, exist_ok=True)
    try:
        return _prepare(sources, tok, target, field, text_unit, docs_per_shard, workers,
                        append_eos, on_shard, encoder, (num_tasks, task_index))  # fmt: skip
    except ConfigError:
        # A source unreadable midway: once it is fixed it no longer matches progress.json.
        if created:
            shutil.rmtree(out, ignore_errors=True)
        raise


def _prepare(sources, tok, target, field, text_unit, docs_per_shard, workers, append_eos, on_shard,
             encoder, task):  # fmt: skip
    import multiprocessing

    out = target.local
    num_tasks, task_index = task
    eos = tok.eos_id if append_eos and encoder is None else None
    settings = _settings(sources, tok, field, text_unit, docs_per_shard, eos)
    if encoder is not None:
        settings["encoder"] = encoder.settings()
    progress = out / "progress.json"
    if progress.exists() and _read_progress(progress) != settings:
        raise ConfigError(
            f"prepare-data: {out} holds a preparation with other inputs or settings "
            "(progress.json); use a new --output directory, or delete that one"
        )
    write_text(progress, json.dumps(settings, indent=1) + "\n")
    dtype = "uint16" if tok.vocab_size <= 2**16 else "uint32"
    done = {p.name[: -len(".docs.npy")] for p in out.glob("shard_*.docs.npy")}
    records: list[dict] = []

    def finished(record: dict) -> None:
        target.publish_shard(record["name"])
        records.append(record)
        if on_shard is not None:
            on_shard(record)

    total = [0]  # chunks of all tasks

    def jobs() -> Iterator[tuple[int, list[str]]]:
        """This task's chunks still to tokenize; finished shards (of a killed run) count."""
        for index, texts in enumerate(chunks(sources, field, text_unit, docs_per_shard)):
            total[0] = index + 1
            if index % num_tasks != task_index:
                continue
            name = f"shard_{index:05d}"
            documents = len(texts) if encoder is None else None  # an encoder's may differ
            if name in done and (shard := _finished_shard(out, name, documents, dtype, tok)):
                finished({**shard, "bytes": 0})
            else:
                yield index, texts

    init = (str(tok.source) if tok.source else "bytes", str(out), dtype, eos, encoder)
    workers = workers or os.cpu_count() or 1
    pending = jobs()
    first = list(itertools.islice(pending, 2))
    pending = itertools.chain(first, pending)
    if workers == 1 or len(first) < 2:  # one chunk to do: no pool of processes for it
        _init_worker(*init)
        for job in pending:
            finished(_tokenize_chunk(job))
    else:
        with multiprocessing.Pool(workers, initializer=_init_worker, initargs=init) as pool:
            # Waves of 2 x workers chunks: memory holds a few chunks, never the corpus.
            while wave := list(itertools.islice(pending, 2 * workers)):
                for record in pool.imap_unordered(_tokenize_chunk, wave):
                    finished(record)
    records.sort(key=lambda r: r["name"])
    if tok.source:
        with errors_naming(out / tok.file_name):
            saved = tok.save(out).name
        target.publish(saved)
    else:
        saved = "bytes"
    base = {
        "format": TOKEN_DIR_FORMAT,
        "dtype": dtype,
        "vocab_size": tok.vocab_size,
        "tokenizer": saved,
        "eos_id": tok.eos_id,
        "bos_id": tok.bos_id,
        "settings": settings,
    }
    if encoder is not None:
        for file_name, text in encoder.files().items():
            write_text(out / file_name, text)
            target.publish(file_name)
        base.update(encoder.meta(), loss_mask=True)
    if num_tasks > 1:
        return finish_task(target, base, records, total[0], num_tasks, task_index)
    meta = data_meta(base, records)
    target.write_text("meta.json", json.dumps(meta, indent=1) + "\n")
    target.done()
    return meta


def _read_progress(path: pathlib.Path) -> dict:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(
            f"{path}: not JSON ({e}): the preparation there cannot be resumed; use a new "
            "--output directory, or delete that one"
        ) from None


def _finished_shard(out: pathlib.Path, name: str, documents: int | None, dtype: str, tok):
    """The record of a shard a killed run finished, checked; None: tokenize it again."""
    record = {"name": name, "documents": documents}
    meta = {"dtype": dtype, "vocab_size": tok.vocab_size, "loss_mask": documents is None}
    try:
        shard = open_shard(out, meta, record)
    except ConfigFileError:
        return None
    top = int(shard.tokens.max()) if len(shard.tokens) else None
    count = len(shard.docs) - 1
    return {**record, "documents": count, "tokens": len(shard.tokens), "max_token_id": top}
