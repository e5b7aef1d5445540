"""Mesh rules for TPU slices: FSDP over the chips of a slice (ICI), data parallel across slices
(DCN), scanned layers with remat, bf16 compute and Splash attention via `flash_attention`.
TPU v5e (16 GiB of HBM) also offloads the layer inputs to host memory
(`remat_policy=offload`; `--modifier scan_layers:remat_policy=full` undoes it). A rule
chooses layouts, memory and kernels, never numerics: the same command trains the same
arithmetic on every chip. int8 matmuls (v5e runs them at twice the bf16 rate) are the
explicit `--modifier quantize:int8` of axplug-quantize (docs/scaling.md).

Selectors: `tpu-v5e-256` (one slice of 256), `tpu-v5e-256x4` (4 slices of 256), `tpu-v5p-512`,
`tpu-v5p-1024`, and what `detect_selector()` gives on a TPU VM: `tpu-<device kind>-<chips per
slice>[x<slices>]` with device kinds `TPU v4`, `TPU v5 lite` or `TPU v5e` (v5e), `TPU v5` or
`TPU v5p` (v5p), `TPU v6 lite` or `TPU v6e` (v6e), e.g. `tpu-tpu-v5-lite-256x4`. Single-slice
rules (`fsdp=-1`) never match a multi-slice `x<slices>` selector: those go to the `...xn` rules,
which keep FSDP inside a slice and put `data` across slices; a multi-slice selector no `xn`
rule covers matches no rule rather than one that would spread FSDP over DCN.
Each rule function carries its chip as `fn.device_spec` (see `axplug.api.with_device_spec`).
"""

from __future__ import annotations

from axplug.api import with_device_spec
from axplug.api.sharding import MeshRule
from axplug_tpu.specs import V4, V5E, V5P, V6E

__all__ = ["RULES"]


def _rule(name: str, spec, pattern: str, mesh: str, remat: str, where: str, extra=()):
    modifiers = [
        mesh,
        f"scan_layers:remat_policy={remat}",
        "compute_dtype:dtype=bfloat16",
        "flash_attention",
        *extra,
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
_MULTI_512 = "FSDP over 512 chips within slices of 512 or more, data parallel across slices"

# Selector stems: what users type, then `tpu-<slug of the device kind>` from detect_selector().
_V4 = "tpu-(tpu-)?v4"
_V5E = "tpu-(v5e|tpu-v5-lite|tpu-v5e)"
_V5P = "tpu-(v5p|tpu-v5|tpu-v5p)"
_V6E = "tpu-(v6e|tpu-v6-lite|tpu-v6e)"


def _one_slice(stem: str) -> str:
    """Pattern: one slice of any size, e.g. `tpu-v5e-256`, never `tpu-v5e-256x4`."""
    return rf"re:{stem}-\d+"


def _slices(stem: str, per_slice: str) -> str:
    """Pattern: several slices of `per_slice` chips, e.g. `tpu-v5e-256x4`."""
    return rf"re:{stem}-({per_slice})x\d+"


RULES = {
    "tpu-v4-slice": _rule("tpu-v4-slice", V4, _one_slice(_V4), "mesh:fsdp=-1", "dots", _SLICE),
    "tpu-v5e-256xn": _rule(
        "tpu-v5e-256xn",
        V5E,
        _slices(_V5E, "256"),
        "mesh:fsdp=256,data=-1",
        "offload",
        _MULTI + ", offload",
    ),
    "tpu-v5e-slice": _rule(
        "tpu-v5e-slice",
        V5E,
        _one_slice("tpu-v5e"),
        "mesh:fsdp=-1",
        "offload",
        _SLICE + ", offload",
    ),
    "tpu-v5e-detected": _rule(
        "tpu-v5e-detected",
        V5E,
        _one_slice("tpu-tpu-(v5-lite|v5e)"),
        "mesh:fsdp=-1",
        "offload",
        _SLICE + ", offload",
    ),
    "tpu-v5p-512xn": _rule(
        "tpu-v5p-512xn",
        V5P,
        _slices(_V5P, "512|1024|2048|4096"),  # 512 divides the slice: FSDP stays inside
        "mesh:fsdp=512,data=-1",
        "dots",
        _MULTI_512,
    ),
    "tpu-v5p-slice": _rule(
        "tpu-v5p-slice", V5P, _one_slice("tpu-v5p"), "mesh:fsdp=-1", "dots", _SLICE
    ),
    "tpu-v5p-detected": _rule(
        "tpu-v5p-detected", V5P, _one_slice("tpu-tpu-v5p?"), "mesh:fsdp=-1", "dots", _SLICE
    ),
    "tpu-v6e-256xn": _rule(
        "tpu-v6e-256xn", V6E, _slices(_V6E, "256"), "mesh:fsdp=256,data=-1", "dots", _MULTI
    ),
    "tpu-v6e-slice": _rule(
        "tpu-v6e-slice", V6E, _one_slice("tpu-v6e"), "mesh:fsdp=-1", "dots", _SLICE
    ),
    "tpu-v6e-detected": _rule(
        "tpu-v6e-detected", V6E, _one_slice("tpu-tpu-(v6-lite|v6e)"), "mesh:fsdp=-1", "dots", _SLICE
    ),
}
globals().update({fn.__name__: fn for fn in RULES.values()})
