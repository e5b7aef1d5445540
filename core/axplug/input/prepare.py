"""`prepare_data`: text, JSONL, Parquet or a saved Hugging Face dataset -> token shards.

Documents are read in order from every source and grouped into chunks of `docs_per_shard`;
each chunk is tokenized by a worker process and written as one shard (`write_shard`), so the
output does not depend on the number of workers. A shard on disk is finished (written, then
renamed), so a rerun after a kill tokenizes only the missing chunks; `progress.json` records
the settings and refuses a rerun that would mix different ones. `meta.json` comes last.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import pathlib
from collections.abc import Callable, Iterator

from axplug.config import ConfigError, ConfigFileError
from axplug.input.token_file import FORMAT, write_shard
from axplug.tokenizer import Tokenizer, load_tokenizer

__all__ = ["prepare_data", "read_documents", "TEXT_UNITS"]

TEXT_UNITS = ("file", "paragraph", "line")


def _text_documents(path: pathlib.Path, unit: str) -> Iterator[str]:
    text = path.read_text(encoding="utf-8", errors="replace")
    if unit == "file":
        parts = [text]
    elif unit == "paragraph":
        parts = text.split("\n\n")
    else:
        parts = text.splitlines()
    yield from (p for p in parts if p.strip())


def _jsonl_documents(path: pathlib.Path, field: str) -> Iterator[str]:
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            record = json.loads(line)
            if field not in record:
                raise ConfigError(f"{path}:{number}: no field {field!r} (use --field NAME)")
            yield str(record[field])


def _parquet_documents(path: pathlib.Path, field: str) -> Iterator[str]:
    try:
        import pyarrow.parquet as pq
    except ImportError as e:
        raise ImportError(f"{path}: reading Parquet needs pyarrow: pip install pyarrow") from e
    table = pq.ParquetFile(path)
    if field not in table.schema_arrow.names:
        raise ConfigError(f"{path}: no column {field!r}; columns: {table.schema_arrow.names}")
    for batch in table.iter_batches(columns=[field]):
        yield from (str(v) for v in batch.column(0).to_pylist() if v is not None)


def _dataset_documents(path: pathlib.Path, field: str) -> Iterator[str]:
    try:
        import datasets
    except ImportError as e:
        raise ImportError(f"{path}: a saved Hugging Face dataset needs `datasets`") from e
    dataset = datasets.load_from_disk(str(path))
    if isinstance(dataset, datasets.DatasetDict):
        dataset = dataset["train"] if "train" in dataset else next(iter(dataset.values()))
    if field not in dataset.column_names:
        raise ConfigError(f"{path}: no column {field!r}; columns: {dataset.column_names}")
    yield from (str(v) for v in dataset[field])


def read_documents(path: str | os.PathLike, *, field: str = "text", text_unit: str = "file"):
    """The documents of one source, by its kind: a directory saved by `datasets`, `.jsonl`,
    `.parquet`, or text (`text_unit`: one document per file, paragraph or line)."""
    path = pathlib.Path(path)
    if path.is_dir():
        return _dataset_documents(path, field)
    if not path.is_file():
        raise ConfigFileError(f"prepare-data: {str(path)!r} does not exist")
    if path.suffix in (".jsonl", ".json"):
        return _jsonl_documents(path, field)
    if path.suffix == ".parquet":
        return _parquet_documents(path, field)
    if text_unit not in TEXT_UNITS:
        raise ConfigError(f"text unit {text_unit!r}: one of {TEXT_UNITS}")
    return _text_documents(path, text_unit)


def _chunks(sources, field, text_unit, size) -> Iterator[list[str]]:
    chunk: list[str] = []
    for source in sources:
        for doc in read_documents(source, field=field, text_unit=text_unit):
            chunk.append(doc)
            if len(chunk) == size:
                yield chunk
                chunk = []
    if chunk:
        yield chunk


_worker: dict = {}


def _init_worker(tokenizer_path: str, directory: str, dtype: str, eos: int | None) -> None:
    _worker.update(
        tok=load_tokenizer(tokenizer_path), dir=pathlib.Path(directory), dtype=dtype, eos=eos
    )


def _tokenize_chunk(job: tuple[int, list[str]]) -> dict:
    index, texts = job
    tail = [] if _worker["eos"] is None else [_worker["eos"]]
    documents = [_worker["tok"].encode(text) + tail for text in texts]
    record = write_shard(_worker["dir"], f"shard_{index:05d}", documents, _worker["dtype"])
    return {**record, "bytes": sum(len(t.encode("utf-8")) for t in texts)}


def _settings(sources, tokenizer: Tokenizer, field, text_unit, docs_per_shard, eos) -> dict:
    digest = hashlib.sha256(tokenizer.source.read_bytes() if tokenizer.source else b"bytes")
    return {
        "sources": [
            {"path": str(pathlib.Path(s).resolve()), "size": _size(pathlib.Path(s))}
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
) -> dict:
    """Tokenizes `sources` into the data directory `output`; returns its meta.json content.

    `on_shard(record)` is called as each shard is done (the CLI's progress bar)."""
    import multiprocessing

    if docs_per_shard < 1:
        raise ConfigError(f"docs_per_shard must be >= 1, got {docs_per_shard}")
    if not sources:
        raise ConfigError("prepare-data: no input files given")
    for source in sources:
        if not pathlib.Path(source).exists():
            raise ConfigFileError(f"prepare-data: {str(source)!r} does not exist")
    try:
        tok = load_tokenizer(tokenizer)
    except (FileNotFoundError, ValueError) as e:
        raise ConfigFileError(str(e)) from None
    out = pathlib.Path(output)
    out.mkdir(parents=True, exist_ok=True)
    eos = tok.eos_id if append_eos else None
    settings = _settings(sources, tok, field, text_unit, docs_per_shard, eos)
    progress = out / "progress.json"
    if progress.exists() and json.loads(progress.read_text()) != settings:
        raise ConfigError(
            f"prepare-data: {out} holds a preparation with other inputs or settings "
            "(progress.json); use a new --output directory, or delete that one"
        )
    progress.write_text(json.dumps(settings, indent=1) + "\n")
    dtype = "uint16" if tok.vocab_size <= 2**16 else "uint32"
    done = {p.name[: -len(".docs.npy")] for p in out.glob("shard_*.docs.npy")}
    records: list[dict] = []

    def finished(record: dict) -> None:
        records.append(record)
        if on_shard is not None:
            on_shard(record)

    def jobs() -> Iterator[tuple[int, list[str]]]:
        """Chunks still to tokenize; finished shards (from a killed run) are counted."""
        for index, texts in enumerate(_chunks(sources, field, text_unit, docs_per_shard)):
            name = f"shard_{index:05d}"
            if name in done and (out / f"{name}.bin").exists():
                size = os.path.getsize(out / f"{name}.bin") // (2 if dtype == "uint16" else 4)
                finished({"name": name, "tokens": size, "documents": len(texts), "bytes": 0})
            else:
                yield index, texts

    init = (str(tok.source) if tok.source else "bytes", str(out), dtype, eos)
    workers = workers or os.cpu_count() or 1
    if workers == 1:
        _init_worker(*init)
        for job in jobs():
            finished(_tokenize_chunk(job))
    else:
        with multiprocessing.Pool(workers, initializer=_init_worker, initargs=init) as pool:
            # Waves of 2 x workers chunks: memory holds a few chunks, never the corpus.
            pending = jobs()
            while wave := list(itertools.islice(pending, 2 * workers)):
                for record in pool.imap_unordered(_tokenize_chunk, wave):
                    finished(record)
    records.sort(key=lambda r: r["name"])
    saved = tok.save(out).name if tok.source else "bytes"
    meta = {
        "format": FORMAT,
        "dtype": dtype,
        "vocab_size": tok.vocab_size,
        "tokenizer": saved,
        "eos_id": tok.eos_id,
        "bos_id": tok.bos_id,
        "num_tokens": sum(r["tokens"] for r in records),
        "num_documents": sum(r["documents"] for r in records),
        "shards": [{k: r[k] for k in ("name", "tokens", "documents")} for r in records],
        "settings": settings,
    }
    tmp = out / ".meta.json.tmp"
    tmp.write_text(json.dumps(meta, indent=1) + "\n")
    os.replace(tmp, out / "meta.json")
    return meta
