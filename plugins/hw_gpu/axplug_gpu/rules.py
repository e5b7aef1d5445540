"""Mesh rules for NVIDIA GPU hosts: FSDP over the (up to 8) NVLink-connected GPUs of a host,
data parallel across 8-GPU hosts, scanned layers with dot-saving remat, bf16 compute and flash
attention. The one-host rules also take a host of 1 to 7 GPUs (a workstation, a cloud VM).

No rule picks `quantize:fp8`: on an H200 the fp8 GEMMs are 1.24x bf16's alone, but a 0.5B
LLaMA step with them was 1.05x slower (scales and amax reductions; bench/RESULTS.md); add
`--modifier quantize:fp8` where the matmuls are large enough to pay.

Each rule function carries its chip as `fn.device_spec` (see `axplug.api.with_device_spec`).
Selectors: `gpu-h100-8` (one host) and `gpu-h100-8x32` (32 hosts of 8), and what
`detect_selector()` gives: `gpu-nvidia-h100-80gb-hbm3-8` on one 8-GPU H100 host,
`gpu-nvidia-h100-80gb-hbm3-8x32` over 32 of them (devices per host, then `x` processes).
"""

from __future__ import annotations

from axplug.api import with_device_spec
from axplug.api.sharding import MeshRule
from axplug_gpu.specs import A100, B200, H100, H200

__all__ = [
    "a100_8",
    "a100_8xn",
    "h100_8",
    "h100_8xn",
    "h200_8",
    "h200_8xn",
    "b200_8",
    "b200_8xn",
]

_COMMON = ["scan_layers:remat_policy=dots", "compute_dtype:dtype=bfloat16", "flash_attention"]


def _rule(chip: str, spec, hosts: bool):
    pattern = f"gpu-*{chip}*-8x*" if hosts else f"re:gpu-.*{chip}.*-[1-8]"
    mesh = "mesh:fsdp=8,data=-1" if hosts else "mesh:fsdp=-1"
    where = "hosts of 8 (FSDP in a host, data parallel across)" if hosts else "one host of 1-8"

    @with_device_spec(spec)
    def rule() -> MeshRule.Config:
        return MeshRule.default_config().set(
            pattern=pattern,
            modifiers=[mesh, *_COMMON],
            description=f"{spec.name}, {where}",
        )

    rule.__name__ = rule.__qualname__ = f"{chip}_8{'xn' if hosts else ''}"
    rule.__doc__ = f"{spec.name}: {where}."
    return rule


a100_8, a100_8xn = _rule("a100", A100, False), _rule("a100", A100, True)
h100_8, h100_8xn = _rule("h100", H100, False), _rule("h100", H100, True)
h200_8, h200_8xn = _rule("h200", H200, False), _rule("h200", H200, True)
b200_8, b200_8xn = _rule("b200", B200, False), _rule("b200", B200, True)
