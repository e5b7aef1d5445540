"""axplug-vision: vision towers (ViT) for vision-language models. Importing it registers
nothing by side effect: the core finds its layers through the entry points in pyproject.toml."""

from axplug_vision.tower import VisionTransformer, patchify

__version__ = "0.1.0"

__all__ = ["VisionTransformer", "patchify"]
