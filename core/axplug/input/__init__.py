"""Input pipelines: step-addressed batches (bytes of a text file, synthetic) and your own data.

`ByteTextInput` and `SyntheticInput` build each batch on the host as a pure function of
`(seed, step)`; `IteratorInput` wraps a user `module:function` that makes an iterator.
"""

from axplug.input.base import Batch, Input, StepInput
from axplug.input.iterator import IteratorInput, resolve_function
from axplug.input.synthetic import SyntheticInput
from axplug.input.text import ByteTextInput, bundled_corpus_path

__all__ = [
    "Batch",
    "Input",
    "StepInput",
    "ByteTextInput",
    "SyntheticInput",
    "IteratorInput",
    "bundled_corpus_path",
    "resolve_function",
]
