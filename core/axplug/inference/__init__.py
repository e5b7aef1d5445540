"""Inference with the training layers: KV-cache decoding, sampling, continuous batching."""

from axplug.inference.disaggregated import DevicePutTransfer, DisaggregatedEngine, KVTransfer
from axplug.inference.engine import Completion, Engine, Request, TokenEvent, generate
from axplug.inference.loading import (
    LoadedModel,
    checkpoint_directory,
    find_tokenizer,
    load_checkpoint,
)
from axplug.inference.paging import OutOfPagesError, PageAllocator
from axplug.inference.sampling import SamplingParams, sample_tokens

__all__ = [
    "Completion",
    "DevicePutTransfer",
    "DisaggregatedEngine",
    "Engine",
    "KVTransfer",
    "LoadedModel",
    "OutOfPagesError",
    "PageAllocator",
    "Request",
    "SamplingParams",
    "TokenEvent",
    "checkpoint_directory",
    "find_tokenizer",
    "generate",
    "load_checkpoint",
    "sample_tokens",
]
