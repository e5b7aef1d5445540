"""The interop face of the plugin API: Hugging Face import and export helpers."""

from axplug import interop as _interop
from axplug.interop import *  # noqa: F403

__all__ = [*_interop.__all__]
