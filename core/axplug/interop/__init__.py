"""Interoperability with other model formats: Hugging Face LLaMA / Mixtral checkpoint import."""

from axplug.interop.hf_config import (
    SUPPORTED_ARCHITECTURES,
    HFImportError,
    HFModelConfig,
    parse_hf_config,
    read_hf_config,
)
from axplug.interop.hf_import import IMPORT_STEP, ImportResult, import_hf
from axplug.interop.hf_params import hf_params
from axplug.interop.hf_trainer_config import hf_modifier_specs, hf_trainer_config
from axplug.interop.safetensors_dir import SafetensorsDir

__all__ = [
    "SUPPORTED_ARCHITECTURES",
    "HFImportError",
    "HFModelConfig",
    "parse_hf_config",
    "read_hf_config",
    "hf_trainer_config",
    "hf_modifier_specs",
    "hf_params",
    "SafetensorsDir",
    "ImportResult",
    "import_hf",
    "IMPORT_STEP",
]
