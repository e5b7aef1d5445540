"""Ahead-of-time planning: compile a train step for a mesh rule's topology without running it.

The target comes from a mesh rule and the `DeviceSpec` attached to it
(`axplug.mesh_rules.resolve_rule`, `device_spec_of`); the FLOPs from the trainer's analytic
model (`axplug.trainer.model_flops_per_step`).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from axplug.api import DeviceSpec
from axplug.api.run import active_parameters, model_flops_per_step
from axplug_aot import plan as aot_plan
from axplug_aot.compiled import (  # noqa: F401 - DUMP_FILES, count_collectives: API
    DUMP_FILES,
    count_collectives,
    dump_step,
    no_persistent_cache,
    xla_flops,
)

__all__ = [
    "AotReport",
    "scale_down",
    "check_batch",
    "compile_report",
    "count_collectives",
    "dump_step",
    "GIB",
]

GIB = 1024**3
_BATCH_AXES = ("data", "fsdp", "expert")  # what `batch` is sharded over by default


def scale_down(shape: tuple[int, ...], axis_names, batch_size: int, max_devices: int):
    """Shrink the pure data-parallel `data` axis (and the global batch with it) by the smallest
    factor that fits `max_devices`. Data replicas hold identical parameters, optimizer state and
    per-device batches, so per-device memory is unchanged; FLOPs are scaled back by the factor.

    Returns (new shape, new batch size, factor)."""
    n = math.prod(shape)
    if n <= max_devices:
        return tuple(shape), batch_size, 1
    i = list(axis_names).index("data")
    for f in range(2, shape[i] + 1):
        if shape[i] % f == 0 and n // f <= max_devices and batch_size % f == 0:
            new = list(shape)
            new[i] //= f
            return tuple(new), batch_size // f, f
    from axplug.api.config import ConfigError

    raise ConfigError(
        f"mesh {tuple(shape)} needs {n} devices; only the data axis ({shape[i]}) can be scaled "
        f"down and no factor of it brings the mesh to <= {max_devices} devices "
        "(raise --max-devices or put more of the mesh on the data axis)"
    )


def check_batch(shape, axis_names, batch_size: int) -> None:
    """Raise a ConfigError when the global batch does not split over the mesh's batch axes."""
    ways = math.prod(d for d, a in zip(shape, axis_names, strict=True) if a in _BATCH_AXES)
    if batch_size % ways:
        from axplug.api.config import ConfigError

        raise ConfigError(
            f"input.batch_size {batch_size} is not divisible by the {ways} batch shards of "
            f"mesh {dict(zip(axis_names, shape, strict=True))}; "
            f"use --set input.batch_size={ways * max(1, batch_size // ways)}"
        )


@dataclasses.dataclass
class AotReport:
    """What `compile_report` measured; `to_dict()` is the `axplug aot --json` output."""

    preset: str
    rule: str
    selector: str
    device: str | None
    num_devices: int  # the target topology
    compiled_devices: int  # fake devices actually compiled for
    mesh_shape: dict[str, int]  # the target mesh
    compiled_mesh_shape: dict[str, int]
    scale_factor: int
    params: int
    active_params: float  # per token (MoE: top_k / num_experts of the expert weights)
    memory: dict[str, int]  # per device, bytes
    hbm_bytes: int | None
    fits: bool | None
    flops_per_step_analytic: float
    flops_per_step_xla: float | None
    scanned_layers: bool
    tokens_per_step: int
    peak_flops_per_device: float | None
    target_mfu: float
    step_time_at_target_mfu_s: float | None
    step_time_s: float | None = None
    mfu_at_step_time: float | None = None
    compile_s: float = 0.0
    collectives: dict[str, int] = dataclasses.field(default_factory=dict)  # in the HLO
    # stages, microbatches, schedule, repeats, bubble (idle share) of a pipelined stack
    pipeline: dict[str, Any] | None = None
    # strategy, ways, work per device (max/min) of context-parallel attention
    context_parallel: dict[str, Any] | None = None
    notes: list[str] = dataclasses.field(default_factory=list)

    @property
    def over_bytes(self) -> int:
        return 0 if self.hbm_bytes is None else self.memory["total"] - self.hbm_bytes

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self) | {"over_bytes": self.over_bytes}


def _host_bytes(mem) -> int:
    """Host-memory bytes of a compiled step (0 where the backend reports none)."""
    parts = ("argument", "output", "temp")
    total = sum(getattr(mem, f"host_{p}_size_in_bytes", 0) or 0 for p in parts)
    return max(0, total - (getattr(mem, "host_alias_size_in_bytes", 0) or 0))


def _summary(model, method: str, *args) -> dict[str, Any] | None:
    """The first module's `method(*args)`, or None: `pipeline_summary()` (a pipelined stack,
    e.g. axplug-pipeline's: stages, microbatches, schedule, repeats, bubble) and
    `context_parallel_summary(seq_ways)` (axplug-context-parallel's attention)."""
    for module in _modules(model):
        if (summary := getattr(module, method, None)) is not None:
            return summary(*args)
    return None


def _scans(model) -> bool:
    """Whether a module of `model` is a scanned stack: a RepeatedTransformer or a subclass (a
    pipeline), a plugin stack's scanned part (a patterned stack's periods) included."""
    from axplug.api.layers import RepeatedTransformer

    return any(isinstance(m, RepeatedTransformer) for m in _modules(model))


def _remat_policies(cfg) -> list[str]:
    """Every layer's `remat_policy` in `cfg`: scanned stacks', and a plugin stack's own."""
    from axplug.api.config import InstantiableConfig, visit
    from axplug.api.layers import BaseLayer

    found = []

    def add(_path, value):
        klass = getattr(value, "klass", None) if isinstance(value, InstantiableConfig) else None
        policy = getattr(value, "remat_policy", None)
        if isinstance(klass, type) and issubclass(klass, BaseLayer) and isinstance(policy, str):
            found.append(policy)

    visit(cfg, add)
    return found


def _modules(module):
    yield module
    for child in module.children.values():
        yield from _modules(child)


def _leaf_bytes(tree) -> int:
    """Bytes of one device's shards of a tree of sharded ShapeDtypeStructs."""
    import jax

    total = 0
    for leaf in jax.tree.leaves(tree):
        shape = leaf.sharding.shard_shape(leaf.shape) if leaf.sharding else leaf.shape
        total += math.prod(shape) * leaf.dtype.itemsize
    return total


def compile_report(
    cfg,
    *,
    num_devices: int,
    spec: DeviceSpec | None = None,
    preset: str = "",
    rule: str = "",
    selector: str = "",
    max_devices: int = 256,
    target_mfu: float = 0.4,
    step_time_s: float | None = None,
    devices: list | None = None,
    devices_note: str | None = None,
    dump_dir: str | None = None,
) -> AotReport:
    """Lower and compile `cfg`'s train step for a `num_devices` mesh, from abstract shapes
    only: nothing is allocated or run. `devices`: compile-only devices of the target
    (`axplug_aot.topology.compile_only_devices`), else the local (fake CPU) devices;
    `devices_note`: why there are none, for the report; `dump_dir`: where to write the
    step's HLO and analysis too (`dump_step`)."""
    import time

    import jax

    from axplug.api.run import Trainer

    builder = cfg.mesh.instantiate()
    target = builder.resolved_shape(num_devices)
    names = tuple(cfg.mesh.axis_names)
    check_batch(target, names, cfg.input.batch_size)
    if devices is not None:  # the target's own compiler: the whole mesh, no scaling down
        max_devices = len(devices)
    shape, batch, factor = scale_down(target, names, cfg.input.batch_size, max_devices)
    n = math.prod(shape)
    if devices is None and len(jax.devices()) < n:
        raise RuntimeError(
            f"compiling for {n} devices but jax has {len(jax.devices())}; set "
            f"XLA_FLAGS=--xla_force_host_platform_device_count={n} before jax starts"
        )
    cfg = cfg.clone(
        mesh=cfg.mesh.clone(mesh_shape=shape),
        input=cfg.input.clone(batch_size=batch),
        summary_writers=[],
        compilation_cache_dir=None,
        output_dir="/nonexistent/axplug-aot",  # nothing is written: the trainer is never run
    )
    plan_notes = []
    if devices is not None:
        plan_notes.append(f"compiled for {devices_note}")
        assert spec is not None  # devices come from a device spec
        cfg = aot_plan.kernels_for(cfg, spec.platform)
    elif spec is not None and spec.platform != jax.default_backend():
        if devices_note:
            plan_notes.append(f"compiled on {n} fake CPU devices: {devices_note}")
        cfg, attention_note = aot_plan.plan_flash_attention(cfg, spec.platform)
        cfg, dtype_note = aot_plan.plan_bfloat16(cfg)
        plan_notes += [note for note in (attention_note, dtype_note) if note]
    trainer = Trainer(cfg, devices=devices or jax.devices()[:n])
    seq = cfg.input.seq_len
    token = jax.ShapeDtypeStruct((batch, seq), jax.numpy.int32, sharding=trainer.batch_sharding)
    abstract_batch = {"input_ids": token, "target_labels": token}
    # A model that takes more than tokens (a vision-language model's images) names them.
    planning_inputs = getattr(type(trainer.model), "planning_inputs", None)
    if planning_inputs is not None:
        for name, (dims, dtype) in planning_inputs(cfg.model, batch, seq).items():
            abstract_batch[name] = jax.ShapeDtypeStruct(dims, dtype, sharding=token.sharding)
    start = time.perf_counter()
    lowered = trainer.lower_step(abstract_batch)
    if dump_dir is None:
        compiled = lowered.compile()
    else:  # the persistent cache's key leaves out op metadata: an entry may hold another
        with no_persistent_cache():  # compile's names, and the dump must show this one's
            compiled = lowered.compile()
    compile_s = time.perf_counter() - start

    mem = compiled.memory_analysis()
    assert mem is not None, "this jax backend reports no memory analysis"
    args, out = mem.argument_size_in_bytes, mem.output_size_in_bytes
    alias, temp = mem.alias_size_in_bytes, mem.temp_size_in_bytes
    state = trainer.layout.abstract
    memory = {
        "params": _leaf_bytes(state["params"]),
        "optimizer": _leaf_bytes(state["opt_state"]),
        "batch": _leaf_bytes(abstract_batch),
        "temp": temp,  # activations kept for the backward pass and scratch
        "argument": args,
        "output": out,
        "alias": alias,
        "generated_code": mem.generated_code_size_in_bytes,
        # On CPU peak_memory_in_bytes leaves out temp memory (shared FACTS): add it ourselves.
        "total": args + out + temp - alias,
        # Host memory the step uses (offloaded activations, host-resident state): not HBM.
        "host": _host_bytes(mem),
    }
    params = sum(math.prod(x.shape) for x in jax.tree.leaves(state["params"]))
    tokens = cfg.input.batch_size * seq * factor
    # The compiled batch is the target's divided by `factor`: scale the FLOPs back.
    flops = model_flops_per_step(cfg, trainer.model) * factor
    active = active_parameters(trainer.model)
    xla = xla_flops(compiled)
    if xla is not None:
        xla *= n * factor  # cost analysis is per device (the SPMD-partitioned program)
    peak = spec.peak_bf16_flops if spec else None
    per_device = flops / (n * factor)
    fits = None if spec is None else memory["total"] <= spec.hbm_bytes
    report = AotReport(
        preset=preset,
        rule=rule,
        selector=selector,
        device=spec.name if spec else None,
        num_devices=num_devices,
        compiled_devices=n,
        mesh_shape=dict(zip(names, target, strict=True)),
        compiled_mesh_shape=dict(zip(names, shape, strict=True)),
        scale_factor=factor,
        params=params,
        active_params=active,
        memory=memory,
        hbm_bytes=spec.hbm_bytes if spec else None,
        fits=fits,
        flops_per_step_analytic=flops,
        flops_per_step_xla=xla,
        scanned_layers=_scans(trainer.model),
        tokens_per_step=tokens,
        peak_flops_per_device=peak,
        target_mfu=target_mfu,
        step_time_at_target_mfu_s=per_device / (peak * target_mfu) if peak else None,
        step_time_s=step_time_s,
        mfu_at_step_time=per_device / (peak * step_time_s) if peak and step_time_s else None,
        compile_s=compile_s,
        collectives=count_collectives(compiled.as_text() or ""),
        pipeline=_summary(trainer.model, "pipeline_summary"),
        context_parallel=_summary(
            trainer.model,
            "context_parallel_summary",
            dict(zip(names, shape, strict=True)).get("seq", 1),
        ),
    )
    report.notes.extend(plan_notes)
    if dump_dir is not None:
        dump_step(lowered, compiled, dump_dir, memory)
        report.notes.append(f"HLO and analysis of the compiled step written to {dump_dir}")
    if report.scanned_layers:
        report.notes.append("XLA's FLOPs count a scanned layer once: MFU uses the analytic count")
    offloads = any(policy.startswith("offload") for policy in _remat_policies(cfg))
    if offloads and not memory["host"]:
        report.notes.append(
            "the offload remat policy's host copies are not separate here (XLA:CPU has one "
            "memory space): temp includes the activations a GPU or TPU keeps in host memory"
        )
    return report
