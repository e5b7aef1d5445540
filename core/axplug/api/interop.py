"""The interop face of the plugin API: Hugging Face import and export helpers."""

from typing import TYPE_CHECKING

from axplug.api._face import face

if TYPE_CHECKING:  # the names, for type checkers; at run time each is read on first use
    from axplug.interop import *  # noqa: F403

__getattr__ = face(__name__, "axplug.interop")
