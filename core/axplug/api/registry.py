"""The registry face of the plugin API: what is installed, and loading it by name."""

from typing import TYPE_CHECKING

from axplug.api._face import face

if TYPE_CHECKING:  # the names, for type checkers; at run time each is read on first use
    from axplug.registry import *  # noqa: F403

__getattr__ = face(__name__, "axplug.registry")
