"""Mesh rules for Trainium instances of 16 chips: FSDP within an instance, data parallel across
instances (`trn2-16x8`: 8 instances), full remat (HBM per chip is small next to its FLOP/s),
bf16 compute, and the NKI kernel via `flash_attention`.

Selectors: `trn1-16`, `trn2-16x8` typed by hand, and what `detect_selector()` gives on an
instance, `neuron-<device kind>-<devices per instance>[x<instances>]`. jax's Neuron devices are
NeuronCores: device kind `NC_v2` on trn1 (32 per trn1.32xlarge), `NC_v3d` on trn2 with two
cores per logical core (the default, 64 per trn2.48xlarge) or `NC_v3` without (128); kinds
naming `trn1`/`trn2` are matched too. One instance: `mesh:fsdp=-1` (FSDP over all its devices,
whatever it counts). Several: `mesh:fsdp=16,data=-1`, so FSDP stays inside an instance (16
divides every per-instance count the patterns accept) and `data` spans instances.

Each rule function carries its chip as `fn.device_spec` (see `axplug.api.with_device_spec`).
"""

from __future__ import annotations

from axplug.api import with_device_spec
from axplug.api.sharding import MeshRule
from axplug_trainium.specs import TRN1, TRN2

__all__ = ["trn1_16", "trn1_16xn", "trn2_16", "trn2_16xn"]

_COMMON = ["scan_layers:remat_policy=full", "compute_dtype:dtype=bfloat16", "flash_attention"]

# chip -> (slugged device kinds, devices per instance) as detect_selector() reports them.
_DETECTED = {
    "trn1": (r"nc-v2|[a-z0-9-]*trn1[a-z0-9-]*", "16|32"),
    "trn2": (r"nc-v3d?|[a-z0-9-]*trn2[a-z0-9-]*", "16|32|64|128"),
}


def _pattern(chip: str, hosts: bool) -> str:
    """`trn2-16` or a detected single-instance selector; with `hosts`, their `x<N>` forms."""
    kinds, counts = _DETECTED[chip]
    many = r"x\d+" if hosts else ""
    return rf"re:{chip}-16{many}|neuron-({kinds})-({counts}){many}"


def _rule(chip: str, spec, hosts: bool):
    mesh = "mesh:fsdp=16,data=-1" if hosts else "mesh:fsdp=-1"
    where = "instances of 16 chips (FSDP in one, data across)" if hosts else "one 16-chip instance"

    @with_device_spec(spec)
    def rule() -> MeshRule.Config:
        return MeshRule.default_config().set(
            pattern=_pattern(chip, hosts),
            modifiers=[mesh, *_COMMON],
            description=f"{spec.name}: {where}",
        )

    rule.__name__ = rule.__qualname__ = f"{chip}_16{'xn' if hosts else ''}"
    rule.__doc__ = f"{spec.name}: {where}."
    return rule


trn1_16, trn1_16xn = _rule("trn1", TRN1, False), _rule("trn1", TRN1, True)
trn2_16, trn2_16xn = _rule("trn2", TRN2, False), _rule("trn2", TRN2, True)
