"""The sharding face of the plugin API: meshes, mesh rules and the sharding scope."""

from typing import TYPE_CHECKING

from axplug.api._face import face

if TYPE_CHECKING:  # the names, for type checkers; at run time each is read on first use
    from axplug.mesh import *  # noqa: F403
    from axplug.mesh_rules import *  # noqa: F403
    from axplug.sharding import *  # noqa: F403

__getattr__ = face(__name__, "axplug.sharding", "axplug.mesh_rules", "axplug.mesh")
