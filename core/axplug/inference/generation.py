"""Running an engine to the end: `run_to_completion`, and `generate` for a list of prompts."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from axplug.inference.engine import Engine
from axplug.inference.requests import Completion, Request, TokenEvent
from axplug.inference.sampling import SamplingParams

__all__ = ["generate", "run_to_completion"]


def run_to_completion(engine, on_token: Callable[[TokenEvent], None] | None = None):
    """Steps `engine` (an Engine or anything with its interface) until every request is
    done; the completions in the order they finished."""
    while engine.has_work:
        for event in engine.step():
            if on_token is not None:
                on_token(event)
    return engine.pop_finished()


def generate(
    model: Any,
    params: Any,
    prompts: Sequence[Sequence[int]],
    sampling: SamplingParams | None = None,
    *,
    num_slots: int | None = None,
    max_len: int | None = None,
    on_token: Callable[[TokenEvent], None] | None = None,
    embeddings: Sequence[Any] | None = None,
) -> list[Completion]:
    """Continues every prompt with `sampling`; the completions in the order of `prompts`.
    `embeddings`: each prompt's `Request.embeddings` (or None)."""
    if not prompts:
        return []
    sampling = sampling or SamplingParams()
    max_len = max_len or max(len(p) for p in prompts) + sampling.max_new_tokens
    engine = Engine(model, params, num_slots=num_slots or len(prompts), max_len=max_len)
    embeddings = embeddings or [None] * len(prompts)
    ids = [
        engine.submit(Request(prompt=p, sampling=sampling, embeddings=e))
        for p, e in zip(prompts, embeddings, strict=True)
    ]
    by_id = {c.id: c for c in engine.run(on_token)}
    return [by_id[i] for i in ids]
