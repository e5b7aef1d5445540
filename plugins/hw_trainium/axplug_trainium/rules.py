"""Mesh rules for Trainium instances of 16 chips: FSDP within an instance, data parallel across
instances (`trn2-16x8`: 8 instances), full remat (HBM per chip is small next to its FLOP/s),
bf16 compute, and the NKI kernel via `flash_attention`.

Each rule function carries its chip as `fn.device_spec` (see `axplug.aot.with_device_spec`).
"""

from __future__ import annotations

from axplug.aot import with_device_spec
from axplug.mesh_rules import MeshRule
from axplug_trainium.specs import TRN1, TRN2

__all__ = ["trn1_16", "trn1_16xn", "trn2_16", "trn2_16xn"]

_COMMON = ["scan_layers:remat_policy=full", "compute_dtype:dtype=bfloat16", "flash_attention"]


def _rule(chip: str, spec, hosts: bool):
    pattern = f"{chip}-16x*" if hosts else f"{chip}-16"
    mesh = "mesh:fsdp=16,data=-1" if hosts else "mesh:fsdp=16"
    where = "instances of 16 chips (FSDP in one, data across)" if hosts else "one 16-chip instance"

    @with_device_spec(spec)
    def rule() -> MeshRule.Config:
        return MeshRule.default_config().set(
            pattern=pattern, modifiers=[mesh, *_COMMON], description=f"{spec.name}: {where}"
        )

    rule.__name__ = rule.__qualname__ = f"{chip}_16{'xn' if hosts else ''}"
    rule.__doc__ = f"{spec.name}: {where}."
    return rule


trn1_16, trn1_16xn = _rule("trn1", TRN1, False), _rule("trn1", TRN1, True)
trn2_16, trn2_16xn = _rule("trn2", TRN2, False), _rule("trn2", TRN2, True)
