"""Input pipelines: step-addressed batches (bytes of a text file, prepared token shards,
synthetic) and your own data.

`ByteTextInput`, `TokenFileInput` and `SyntheticInput` build each batch on the host as a pure
function of `(seed, step)`; `IteratorInput` wraps a user `module:function` that makes an
iterator. They are registered as `axplug.inputs` (`--input NAME[:k=v]`).
"""

from axplug.input.base import (
    Batch,
    Input,
    Policy,
    StepInput,
    batch_shape,
    check_split,
    check_step,
    data_vocab_size,
    eval_split_of,
    field_error,
    input_class,
)
from axplug.input.data_dir import TOKEN_DIR_FORMAT, open_shards, read_meta, write_shard
from axplug.input.iterator import IteratorInput, resolve_function
from axplug.input.prefetch import prefetched
from axplug.input.prepare import DocumentEncoder, prepare_data
from axplug.input.sources import read_documents, reads_directories, source_kind
from axplug.input.synthetic import SyntheticInput
from axplug.input.text import ByteTextInput, bundled_corpus_path
from axplug.input.token_file import IGNORE_LABEL, TokenFileInput

__all__ = [
    "Batch",
    "Input",
    "Policy",
    "StepInput",
    "ByteTextInput",
    "SyntheticInput",
    "IteratorInput",
    "TokenFileInput",
    "batch_shape",
    "check_split",
    "check_step",
    "field_error",
    "prefetched",
    "data_vocab_size",
    "input_class",
    "eval_split_of",
    "bundled_corpus_path",
    "resolve_function",
    "prepare_data",
    "DocumentEncoder",
    "IGNORE_LABEL",
    "open_shards",
    "read_meta",
    "read_documents",
    "reads_directories",
    "source_kind",
    "write_shard",
    "TOKEN_DIR_FORMAT",
]
