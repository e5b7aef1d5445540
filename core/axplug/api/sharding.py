"""The sharding face of the plugin API: meshes, mesh rules and the sharding scope."""

from axplug import mesh as _mesh
from axplug import mesh_rules as _mesh_rules
from axplug import sharding as _sharding
from axplug.mesh import *  # noqa: F403
from axplug.mesh_rules import *  # noqa: F403
from axplug.sharding import *  # noqa: F403

__all__ = [*_sharding.__all__, *_mesh_rules.__all__, *_mesh.__all__]
