"""The reference model's log-probabilities of a preference directory's tokens, stored beside
its shards as token values (`shard_NNNNN.reference_logps.bin`, float32 per token)."""

from __future__ import annotations

import json
import pathlib
from collections.abc import Callable

import numpy as np

from axplug.api.config import ConfigError
from axplug_dpo.data import REFERENCE

__all__ = ["store_reference", "token_logps"]


def token_logps(engine, tokens: np.ndarray, docs: np.ndarray, batch: int = 64) -> np.ndarray:
    """log p(token | the document's tokens before it) per token (0 at each document's first),
    scored by `engine` (an `axplug.inference.Engine`: prompt-only requests, `batch` at once)."""
    from axplug.api.run import Request, SamplingParams

    scoring = SamplingParams(max_new_tokens=0, prompt_logprobs=0)
    out = np.zeros(len(tokens), np.float32)
    starts, ends = docs[:-1], docs[1:]
    for first in range(0, len(starts), batch):
        wave = range(first, min(first + batch, len(starts)))
        for d in wave:
            engine.submit(Request(tokens[starts[d] : ends[d]].tolist(), scoring, id=d))
        for completion in engine.run():
            s, e = starts[completion.id], ends[completion.id]
            scored = completion.prompt_logprobs[1:]  # the first token has no context
            out[s + 1 : e] = [entry.logprob for entry in scored]
    return out


def store_reference(
    data_dir: str, loaded, *, num_slots: int = 8, on_shard: Callable | None = None
) -> dict:
    """Computes `loaded`'s (an `axplug.inference.LoadedModel`) log-probabilities of every token
    of `data_dir` and writes them as its `reference_logps` token values; returns the entry.

    meta.json drops the entry first and gets it back last, so a directory being rewritten
    never reads as complete."""
    from axplug.api.checkpoint import atomic_file, write_text
    from axplug.api.data import open_shards, read_meta
    from axplug.api.run import Engine

    root = pathlib.Path(data_dir)
    meta = read_meta(root)
    if not meta.get("preferences"):
        raise ConfigError(f"{data_dir}: not preference data (axplug prepare-preferences)")
    vocab = loaded.vocab_size
    if meta["vocab_size"] > vocab:
        raise ConfigError(
            f"{data_dir}: a vocabulary of {meta['vocab_size']} tokens, more than the model's "
            f"{vocab}: prepare the data with the model's tokenizer"
        )

    shards = open_shards(root, meta)
    longest = max((int(np.diff(s.docs).max(initial=1)) for s in shards), default=1)
    engine = Engine(loaded.model, loaded.params, num_slots=num_slots, max_len=longest + 1,
                    mesh=loaded.mesh, axis_rules=loaded.axis_rules)  # fmt: skip
    meta.pop("token_values", None)
    write_text(root / "meta.json", json.dumps(meta, indent=1) + "\n")
    for shard in shards:
        values = token_logps(engine, np.asarray(shard.tokens), shard.docs)
        with atomic_file(shard.path.with_name(f"{shard.path.stem}.{REFERENCE}.bin")) as f:
            values.tofile(f)
        if on_shard is not None:
            on_shard(shard.path.name)
    entry = {"dtype": "float32", "checkpoint": loaded.lineage[0][0], "step": loaded.step}
    meta["token_values"] = {REFERENCE: entry}
    write_text(root / "meta.json", json.dumps(meta, indent=1) + "\n")
    return entry
