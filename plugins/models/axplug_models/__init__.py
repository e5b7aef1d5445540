"""Hugging Face model families for axplug, each an `axplug.architectures` contribution.

A family picks the layer classes and names the tensors; the layers read and write their own
config.json fields (docs/model-families.md). Import, decode, fine-tune and export are the
core's `axplug import-hf` / `generate` / `train --from` / `export-hf`.
"""

__version__ = "0.1.0"
__all__ = ["__version__"]
