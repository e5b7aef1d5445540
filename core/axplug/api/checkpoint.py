"""The checkpoint face of the plugin API: checkpoints, storage, files written whole."""

from typing import TYPE_CHECKING

from axplug.api._face import face

if TYPE_CHECKING:  # the names, for type checkers; at run time each is read on first use
    from axplug.checkpoint import *  # noqa: F403
    from axplug.files import *  # noqa: F403

__getattr__ = face(__name__, "axplug.checkpoint", "axplug.files")
