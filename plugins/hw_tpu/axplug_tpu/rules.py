"""Mesh rules for TPU slices: FSDP over the chips of a slice (ICI), data parallel across slices
(DCN), scanned layers with remat, bf16 compute and Splash attention via `flash_attention`.

Selectors: `tpu-v5e-256` (one slice of 256), `tpu-v5e-256x4` (4 slices of 256), `tpu-v5p-512`,
`tpu-v5p-1024`. `*-detected` rules match what `detect_selector()` gives on a TPU VM, whose
device kinds read `TPU v4`, `TPU v5 lite` (v5e), `TPU v5` (v5p), `TPU v6 lite` (v6e). Rules are
tried by name in sorted order, so `tpu-v5e-256xn` is tried before `tpu-v5e-slice`.
Each rule function carries its chip as `fn.device_spec` (see `axplug.aot.with_device_spec`).
"""

from __future__ import annotations

from axplug.aot import with_device_spec
from axplug.mesh_rules import MeshRule
from axplug_tpu.specs import V4, V5E, V5P, V6E

__all__ = ["RULES"]


def _rule(name: str, spec, pattern: str, mesh: str, remat: str, where: str):
    modifiers = [
        mesh,
        f"scan_layers:remat_policy={remat}",
        "compute_dtype:dtype=bfloat16",
        "flash_attention",
    ]

    @with_device_spec(spec)
    def rule() -> MeshRule.Config:
        return MeshRule.default_config().set(
            pattern=pattern, modifiers=modifiers, description=f"{spec.name}: {where}"
        )

    rule.__name__ = rule.__qualname__ = name.replace("-", "_")
    rule.__doc__ = f"{spec.name}: {where}."
    return rule


_SLICE = "FSDP over every chip of one slice"
_MULTI = "FSDP within 256-chip slices, data parallel across slices"
_MULTI_512 = "FSDP within 512-chip slices, data parallel across slices"

RULES = {
    "tpu-v4-slice": _rule("tpu-v4-slice", V4, "tpu-*v4-*", "mesh:fsdp=-1", "dots", _SLICE),
    "tpu-v5e-256xn": _rule(
        "tpu-v5e-256xn", V5E, "tpu-v5e-256x*", "mesh:fsdp=256,data=-1", "full", _MULTI
    ),
    "tpu-v5e-slice": _rule("tpu-v5e-slice", V5E, "tpu-v5e-*", "mesh:fsdp=-1", "full", _SLICE),
    "tpu-v5e-detected": _rule(
        "tpu-v5e-detected", V5E, "tpu-tpu-v5-lite-*", "mesh:fsdp=-1", "full", _SLICE
    ),
    "tpu-v5p-512xn": _rule(
        "tpu-v5p-512xn", V5P, "tpu-v5p-512x*", "mesh:fsdp=512,data=-1", "dots", _MULTI_512
    ),
    "tpu-v5p-slice": _rule("tpu-v5p-slice", V5P, "tpu-v5p-*", "mesh:fsdp=-1", "dots", _SLICE),
    "tpu-v5p-detected": _rule(
        "tpu-v5p-detected", V5P, "tpu-tpu-v5-[0-9]*", "mesh:fsdp=-1", "dots", _SLICE
    ),
    "tpu-v6e-256xn": _rule(
        "tpu-v6e-256xn", V6E, "tpu-v6e-256x*", "mesh:fsdp=256,data=-1", "dots", _MULTI
    ),
    "tpu-v6e-slice": _rule("tpu-v6e-slice", V6E, "tpu-v6e-*", "mesh:fsdp=-1", "dots", _SLICE),
    "tpu-v6e-detected": _rule(
        "tpu-v6e-detected", V6E, "tpu-tpu-v6-lite-*", "mesh:fsdp=-1", "dots", _SLICE
    ),
}
globals().update({fn.__name__: fn for fn in RULES.values()})
