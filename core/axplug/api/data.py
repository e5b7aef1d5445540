"""The data face of the plugin API: input pipelines, token files and tokenizers."""

from typing import TYPE_CHECKING

from axplug.api._face import face

if TYPE_CHECKING:  # the names, for type checkers; at run time each is read on first use
    from axplug.input import *  # noqa: F403
    from axplug.tokenizer import *  # noqa: F403

__getattr__ = face(__name__, "axplug.input", "axplug.tokenizer")
