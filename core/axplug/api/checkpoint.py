"""The checkpoint face of the plugin API: checkpoints, storage, files written whole."""

from axplug import checkpoint as _checkpoint
from axplug import files as _files
from axplug.checkpoint import *  # noqa: F403
from axplug.files import *  # noqa: F403

__all__ = [*_checkpoint.__all__, *_files.__all__]
