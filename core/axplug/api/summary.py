"""The summary face of the plugin API: summary writers and the metrics files they read and write."""

from typing import TYPE_CHECKING

from axplug.api._face import face

if TYPE_CHECKING:  # the names, for type checkers; at run time each is read on first use
    from axplug.summary import *  # noqa: F403

__getattr__ = face(__name__, "axplug.summary")
