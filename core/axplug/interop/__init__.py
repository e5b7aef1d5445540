"""Hugging Face checkpoints in and out, through the installed architectures
(`axplug.architectures` entries, all from plugins; docs/model-families.md).

Names are read on first use (PEP 562): `axplug import-hf` reads and checks config.json through
`axplug.interop.hf_config` before anything imports jax. No module is named like a function it
exports: importing it would shadow the function on the package.
"""

from typing import TYPE_CHECKING

from axplug.api._face import lazy

if TYPE_CHECKING:
    from axplug.interop.from_config import (
        HFSource,
        config_json_preset,
        hf_trainer_config,
        parse_hf_config,
        read_hf_config,
    )
    from axplug.interop.hf_config import HFImportError, load_architecture, registered_architectures
    from axplug.interop.hf_export import HFExportError, check_output, export_hf, hf_config_for
    from axplug.interop.hf_import import IMPORT_STEP, ImportResult, import_hf
    from axplug.interop.hf_walk import differences, read_fields, write_fields
    from axplug.interop.llama import (
        attention_tensors,
        decoder_tensors,
        linear_tensors,
        mlp_tensors,
        norm_tensors,
    )
    from axplug.interop.safetensors_dir import SafetensorsDir
    from axplug.interop.tensors import flatten, hf_params, hf_tensors, unflatten

_HOMES = {
    **dict.fromkeys(
        ("HFImportError", "load_architecture", "registered_architectures"), "hf_config"
    ),
    **dict.fromkeys(("IMPORT_STEP", "ImportResult", "import_hf"), "hf_import"),
    **dict.fromkeys(("hf_params", "hf_tensors", "flatten", "unflatten"), "tensors"),
    **dict.fromkeys(("HFExportError", "export_hf", "hf_config_for", "check_output"), "hf_export"),
    **dict.fromkeys(("read_fields", "write_fields", "differences"), "hf_walk"),
    **dict.fromkeys(
        (
            "HFSource",
            "hf_trainer_config",
            "parse_hf_config",
            "read_hf_config",
            "config_json_preset",
        ),
        "from_config",
    ),
    **dict.fromkeys(
        (
            "attention_tensors",
            "decoder_tensors",
            "linear_tensors",
            "mlp_tensors",
            "norm_tensors",
        ),
        "llama",
    ),  # fmt: skip
    "SafetensorsDir": "safetensors_dir",
}


__getattr__ = lazy(__name__, _HOMES)


__all__ = [
    "HFImportError",
    "HFExportError",
    "load_architecture",
    "HFSource",
    "registered_architectures",
    "parse_hf_config",
    "read_hf_config",
    "hf_trainer_config",
    "config_json_preset",
    "hf_params",
    "hf_tensors",
    "flatten",
    "unflatten",
    "export_hf",
    "hf_config_for",
    "check_output",
    "SafetensorsDir",
    "ImportResult",
    "import_hf",
    "IMPORT_STEP",
    # The LLaMA tensor layout a model-family plugin builds on (docs/model-families.md).
    "decoder_tensors",
    "linear_tensors",
    "norm_tensors",
    "attention_tensors",
    "mlp_tensors",
    # The walk of the layers' hf_read / hf_write, for a layer that writes its children's
    # fields itself (`hf_writes_subtree`) or reads them again.
    "read_fields",
    "write_fields",
    "differences",
]


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
