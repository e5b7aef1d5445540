"""The config face of the plugin API: config classes and tools, modifiers, presets."""

from typing import TYPE_CHECKING

from axplug.api._face import face

if TYPE_CHECKING:  # the names, for type checkers; at run time each is read on first use
    from axplug.component_spec import *  # noqa: F403
    from axplug.config import *  # noqa: F403
    from axplug.modifiers import *  # noqa: F403
    from axplug.presets import *  # noqa: F403

__getattr__ = face(
    __name__, "axplug.config", "axplug.modifiers", "axplug.presets", "axplug.component_spec"
)
