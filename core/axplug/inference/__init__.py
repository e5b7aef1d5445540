"""Inference with the training layers: KV-cache decoding, sampling, continuous batching."""

from axplug.inference.constraints import Guide, TokenConstraint
from axplug.inference.engine import Engine
from axplug.inference.generation import generate, run_to_completion
from axplug.inference.loading import (
    LoadedModel,
    find_tokenizer,
    load_checkpoint,
)
from axplug.inference.paging import OutOfPagesError, PageAllocator
from axplug.inference.requests import Completion, Logprob, Request, RequestState, TokenEvent
from axplug.inference.sampling import SamplingParams, penalized, sample_tokens, token_logprobs
from axplug.inference.speculation import Proposer, verify_drafts

__all__ = [
    "Completion",
    "Engine",
    "Guide",
    "LoadedModel",
    "Logprob",
    "OutOfPagesError",
    "PageAllocator",
    "Proposer",
    "Request",
    "RequestState",
    "SamplingParams",
    "TokenConstraint",
    "TokenEvent",
    "find_tokenizer",
    "generate",
    "load_checkpoint",
    "penalized",
    "run_to_completion",
    "sample_tokens",
    "token_logprobs",
    "verify_drafts",
]
