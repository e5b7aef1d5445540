"""The layers face of the plugin API: the core layers, and `functional` to call any layer."""

from typing import TYPE_CHECKING

from axplug.api._face import face

if TYPE_CHECKING:  # the names, for type checkers; at run time each is read on first use
    from axplug.layers import *  # noqa: F403

__getattr__ = face(__name__, "axplug.layers")
