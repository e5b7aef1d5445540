"""axplug-vision: vision-language models (docs/vision.md). Importing it registers nothing by
side effect: the core finds its layers, architectures and presets through the entry points in
pyproject.toml."""

from axplug_vision.model import VisionLanguageModel
from axplug_vision.qwen_tower import QwenVisionTower
from axplug_vision.tower import VisionTransformer, patchify

__version__ = "0.1.0"

__all__ = ["QwenVisionTower", "VisionLanguageModel", "VisionTransformer", "patchify"]
