"""The config face of the plugin API: config classes and tools, modifiers, presets."""

from axplug import config as _config
from axplug import modifiers as _modifiers
from axplug import presets as _presets
from axplug.config import *  # noqa: F403
from axplug.modifiers import *  # noqa: F403
from axplug.presets import *  # noqa: F403

__all__ = [*_config.__all__, *_modifiers.__all__, *_presets.__all__]
