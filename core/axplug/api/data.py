"""The data face of the plugin API: input pipelines, token files and tokenizers."""

from axplug import input as _input
from axplug import tokenizer as _tokenizer
from axplug.input import *  # noqa: F403
from axplug.tokenizer import *  # noqa: F403

__all__ = [*_input.__all__, *_tokenizer.__all__]
