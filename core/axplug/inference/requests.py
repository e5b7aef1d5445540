"""What the engines pass around: requests, their running state, tokens and completions."""

from __future__ import annotations

import dataclasses
import functools
import hashlib
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from axplug.inference.sampling import SamplingParams

__all__ = ["Request", "Completion", "Logprob", "TokenEvent", "RequestState", "seed_key"]


@dataclasses.dataclass
class Request:
    """A prompt (token ids) and how to continue it; `id` defaults to a counter. A
    `constraint` (`axplug.inference.TokenConstraint`, its own per request) limits what it
    may generate. `adapter` picks one of the model's adapter slots (`Engine(adapter_slots=)`;
    layers read each row's as `side_input("adapter")`); 0: the model as it is. `embeddings`
    (prompt indices [n], vectors [n, dim]) take the place of those prompt tokens' embeddings
    (an image's features at its placeholders), for a model whose `extend_step` takes
    `inserted`; the prefix cache keys its pages on them too."""

    prompt: Sequence[int]
    sampling: SamplingParams = dataclasses.field(default_factory=SamplingParams)
    id: Any = None
    constraint: Any = None
    adapter: int = 0
    embeddings: tuple[Any, Any] | None = None


@dataclasses.dataclass(frozen=True)
class Logprob:
    """A token's log-probability under the model and its rank there (1: the most likely),
    and the most likely tokens' (id, logprob), most likely first, as many as asked for."""

    token: int
    logprob: float
    rank: int = 1
    top: tuple[tuple[int, float], ...] = ()

    @classmethod
    def of(cls, token: int, chosen, rank, top_ids, top_values, top_n: int) -> Logprob:
        """From a row of the step's scores (`token_logprobs`), keeping `top_n` alternatives."""
        top = tuple(zip(top_ids[:top_n].tolist(), top_values[:top_n].tolist(), strict=True))
        return cls(token, float(chosen), int(rank), top)


@dataclasses.dataclass
class Completion:
    """A finished request: its generated ids and why it stopped (`stop`, `length`, `cancelled`).

    With `SamplingParams.logprobs`, `output_logprobs` has one entry per output id; with
    `prompt_logprobs`, `prompt_logprobs` one per prompt id, None for the first (it has no
    context to be predicted from).
    """

    id: Any
    prompt_ids: list[int]
    output_ids: list[int]
    finish_reason: str
    time_to_first_token_s: float
    output_logprobs: list[Logprob] | None = None
    prompt_logprobs: list[Logprob | None] | None = None


@dataclasses.dataclass(frozen=True)
class TokenEvent:
    """One generated token of a request (None when the request ended on a stop token, or
    without generating: `max_new_tokens=0`), with its Logprob when the request asked."""

    id: Any
    token: int | None
    finish_reason: str | None = None
    logprob: Logprob | None = None


@dataclasses.dataclass
class RequestState:
    """A request inside an engine: what it generated, its pages, what is cached."""

    request: Request
    submitted: float
    output: list[int] = dataclasses.field(default_factory=list)
    pages: list[int] = dataclasses.field(default_factory=list)
    first_token_s: float = 0.0
    admitted: int = 0  # admission order: the newest is preempted first
    cached: int = 0  # tokens of `context` in the cache
    start: int | None = None  # the cache length its row starts from next step (None: as is)
    digests: list[bytes] = dataclasses.field(default_factory=list)  # of full context pages
    registered: int = 0  # its first pages named in the prefix cache
    output_logprobs: list[Logprob] = dataclasses.field(default_factory=list)
    # By prompt position, filled as the prompt is cached (again, identically, after a
    # preemption); position 0 stays None.
    prompt_logprobs: list[Logprob | None] = dataclasses.field(default_factory=list)

    def __post_init__(self):
        if self.request.sampling.prompt_logprobs is not None and not self.prompt_logprobs:
            self.prompt_logprobs = [None] * len(self.request.prompt)

    @property
    def context(self) -> list[int]:
        """The prompt and the generated tokens: all but the last are cached once decoding."""
        return [*self.request.prompt, *self.output]

    @functools.cached_property
    def prefix_salt(self) -> tuple[tuple[int, bytes], ...]:
        """What its cached pages depend on besides tokens, each from a position on: another
        adapter (from 0), embeddings (from the first embedded token: text pages before an
        image are shared with requests that send other images)."""
        salts = [(0, self.request.adapter.to_bytes(4, "little"))] if self.request.adapter else []
        if self.request.embeddings is not None:
            where, vectors = (np.ascontiguousarray(a) for a in self.request.embeddings)
            digest = hashlib.blake2b(where.tobytes() + vectors.tobytes(), digest_size=16)
            salts.append((int(where.min()) if where.size else 0, digest.digest()))
        return tuple(salts)

    @property
    def context_len(self) -> int:
        return len(self.request.prompt) + len(self.output)

    @property
    def decoding(self) -> bool:
        """Whether everything but its last token is cached (the prompt is done)."""
        return bool(self.output) and self.cached == self.context_len - 1

    def note_prompt_logprobs(self, fed: int, scores: tuple) -> None:
        """Logprobs of the prompt tokens that the `fed` positions fed this step predict."""
        prompt, top_n = self.request.prompt, self.request.sampling.prompt_logprobs
        for j in range(fed):
            index = self.cached + j + 1
            if index >= len(prompt):
                break
            self.prompt_logprobs[index] = Logprob.of(prompt[index], *[a[j] for a in scores], top_n)

    def feed(self, limit: int) -> list[int]:
        """The tokens this row writes next: its last token when decoding, else up to `limit`
        uncached prompt (or, after a preemption, prompt and output) tokens. A run of embedded
        tokens (an image's, which may attend to each other both ways) is never split: the
        chunk ends before it, or takes it whole when it starts the chunk."""
        if self.decoding:
            return self.output[-1:]  # no copy of the whole context per step
        end = self.cached + limit
        if self.request.embeddings is not None:
            end = _unsplit(np.asarray(self.request.embeddings[0]), self.cached, end)
        return self.context[self.cached : end]

    def completion(self, reason: str) -> Completion:
        """This request, finished for `reason`."""
        sampling = self.request.sampling
        return Completion(
            self.request.id, list(self.request.prompt), self.output, reason, self.first_token_s,
            self.output_logprobs if sampling.logprobs is not None else None,
            self.prompt_logprobs if sampling.prompt_logprobs is not None else None,
        )  # fmt: skip


def _unsplit(where: np.ndarray, start: int, end: int) -> int:
    """`end` moved off the inside of a run of consecutive indices in `where` (sorted): back
    to the run's start, or past its end when the run begins at or before `start`."""
    i = int(np.searchsorted(where, end))
    if not (0 < i < len(where) and where[i] == end and where[i - 1] == end - 1):
        return end
    first = i - 1
    while first > 0 and where[first - 1] == where[first] - 1:
        first -= 1
    if where[first] > start:
        return int(where[first])
    last = i
    while last + 1 < len(where) and where[last + 1] == where[last] + 1:
        last += 1
    return int(where[last]) + 1


def seed_key(seed: int) -> np.ndarray:
    """`jax.random.PRNGKey(seed)` as a host array, without a device op per request."""
    if jax.config.jax_default_prng_impl == "threefry2x32" and 0 <= seed < 2**64:
        return np.array([seed >> 32, seed & 0xFFFFFFFF], np.uint32)  # threefry's seeding
    return np.asarray(jax.random.PRNGKey(seed))
