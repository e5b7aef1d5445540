"""config.json -> the trainer config of the imported model: the architecture picks the layer
classes, each layer reads its own fields, and a field no layer read is refused by name."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from axplug.api._hf import HFFields
from axplug.interop.hf_config import (
    HFImportError,
    architecture_name,
    load_architecture,
    read_config_json,
)

__all__ = [
    "HFSource",
    "read_hf_config",
    "parse_hf_config",
    "hf_trainer_config",
    "hf_fields",
    "config_json_preset",
]

# Checkpoint dtypes -> the compute dtype the imported model runs in (norms, softmax and the
# router stay float32 in axplug whatever this is).
_COMPUTE_DTYPES = {"float32": "float32", "bfloat16": "bfloat16", "float16": "bfloat16"}


@dataclasses.dataclass(frozen=True)
class HFSource:
    """A checkpoint's config.json and the installed architecture that reads it."""

    architecture: str
    raw: dict = dataclasses.field(repr=False)
    source: str = "config.json"


def read_hf_config(directory: str) -> HFSource:
    """`directory/config.json` and its architecture, which must be installed (no jax)."""
    raw, path = read_config_json(directory)
    return parse_hf_config(raw, source=path)


def parse_hf_config(raw: dict, *, source: str = "config.json") -> HFSource:
    """A parsed config.json and its architecture, which must be installed (no jax)."""
    return HFSource(architecture_name(raw, source), dict(raw), source)


def hf_fields(raw: dict, arch: Any, source: str = "config.json") -> HFFields:
    """The fields of `raw` as the architecture's layers read them."""
    return HFFields(
        raw,
        source=source,
        defaults=arch.defaults,
        aliases=arch.aliases,
        implied=arch.implied,
    )


def model_from_fields(arch: Any, fields: HFFields) -> Any:
    """The architecture's trainer config with every layer's fields read; problems raise, all
    named at once, and so does every field that nothing read."""
    from axplug.interop.hf_walk import read_fields

    cfg = arch.base_config(fields)
    read_fields(cfg.model, fields)
    dtype = str(fields.raw.get("torch_dtype") or fields.raw.get("dtype") or "float32")
    if dtype not in _COMPUTE_DTYPES:
        fields.problem(f"torch_dtype={dtype!r} (supported: {', '.join(_COMPUTE_DTYPES)})")
    cfg.model.compute_dtype = _COMPUTE_DTYPES.get(dtype, "float32")
    if "quantization_config" in fields.raw:
        fields.problem("quantization_config is set (quantized weights are not supported)")
        fields.read.add("quantization_config")
    unread = fields.unread()
    if unread:
        fields.problem(
            f"field(s) {', '.join(f'{n}={v!r}' for n, v in unread.items())} are read by no "
            f"layer of a {arch.architecture} (no installed plugin maps them)"
        )
    if fields.problems:
        raise HFImportError(
            f"{fields.source}: cannot import this {arch.architecture}: "
            + "; ".join(fields.problems)
        )
    return cfg


def hf_trainer_config(
    hf: HFSource,
    *,
    output_dir: str,
    modifiers: Sequence[str] = (),
    overrides: Sequence[str] = (),
) -> Any:
    """The trainer config of the imported model, then `modifiers`, then `overrides`.

    The layer stack is unrolled (`StackedTransformer`); `scan_layers` in `modifiers` scans it.
    """
    from axplug.config import apply_overrides
    from axplug.modifiers import make_modifier

    arch = load_architecture(hf.architecture)
    fields = hf_fields(hf.raw, arch, hf.source)
    cfg = model_from_fields(arch, fields)
    max_positions = hf.raw.get(fields.name("max_position_embeddings"))
    if isinstance(max_positions, int) and max_positions > 0:
        cfg.input.seq_len = min(cfg.input.seq_len, max_positions)
    cfg.output_dir = output_dir
    for spec in modifiers:
        cfg = make_modifier(spec)(cfg)
    return apply_overrides(cfg, overrides)


def config_json_preset(
    name: str,
    description: str,
    raw: dict,
    modifiers: Sequence[str] = ("scan_layers:remat_policy=full",),
) -> Any:
    """A planning preset whose model is what `axplug import-hf` builds from the config.json
    `raw` then `modifiers` (default: the stack scanned with full remat), in bfloat16: the
    published shapes by construction."""
    from axplug.presets import Preset

    def build() -> Any:
        cfg = hf_trainer_config(
            parse_hf_config(dict(raw), source=f"preset {name}"),
            output_dir=f"runs/{name}",
            modifiers=modifiers,
        )
        cfg.model.compute_dtype = "bfloat16"
        return cfg

    return Preset(name, description, build, config_json=dict(raw))
