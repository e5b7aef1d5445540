"""The kernels face of the plugin API: the core kernels to fall back to, and kernel dispatch."""

from typing import TYPE_CHECKING

from axplug.api._face import face

if TYPE_CHECKING:  # the names, for type checkers; at run time each is read on first use
    from axplug.kernels import *  # noqa: F403

__getattr__ = face(__name__, "axplug.kernels")
