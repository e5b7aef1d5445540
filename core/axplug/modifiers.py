"""Modifier specs (`name:key=value,...`) and the core's own config modifiers."""

from __future__ import annotations

from axplug.component_spec import component_config, resolve_spec
from axplug.config import (
    ConfigBase,
    ConfigError,
    ConfigModifier,
    apply_overrides,
    config_class,
    find_configs,
    replace_config,
)
from axplug.mesh import MESH_AXES, PIPELINE_AXIS

__all__ = [
    "parse_modifier_spec",
    "make_modifier",
    "SetModifier",
    "MeshShapeModifier",
    "ScanLayersModifier",
    "PipelineModifier",
    "QuantizeModifier",
    "ComputeDtypeModifier",
    "PagedKVCacheModifier",
]


def parse_modifier_spec(spec: str) -> tuple[str, dict]:
    """`moe:num_experts=8,top_k=2` -> ("moe", {...}); `axplug-moe:moe` keeps its qualifier;
    `quantize:int8` -> ("quantize", {"mode": "int8"})."""
    return resolve_spec("modifiers", spec, "modifier")


def make_modifier(spec: str) -> ConfigModifier:
    """The registered modifier named by `spec`, configured with its key=value pairs."""
    return component_config("modifiers", spec, "modifier").instantiate()


class SetModifier(ConfigModifier):
    """Applies `path=value` overrides, like `--set`."""

    @config_class
    class Config(ConfigModifier.Config):
        overrides: list[str] = []

    def __call__(self, cfg: ConfigBase) -> ConfigBase:
        return apply_overrides(cfg, self._config.overrides)


class MeshShapeModifier(ConfigModifier):
    """Sets `mesh.mesh_shape` from per-axis sizes, e.g. `mesh:fsdp=-1,model=2`.

    `pipeline=S` adds a `pipeline` axis (outermost) for the `pipeline` modifier's stages.
    """

    @config_class
    class Config(ConfigModifier.Config):
        data: int = 1
        fsdp: int = 1
        expert: int = 1
        seq: int = 1
        model: int = 1
        pipeline: int = 1

    def __call__(self, cfg: ConfigBase) -> ConfigBase:
        names = MESH_AXES if self._config.pipeline == 1 else (PIPELINE_AXIS, *MESH_AXES)
        shape = tuple(getattr(self._config, axis) for axis in names)
        return cfg.clone(mesh=cfg.mesh.clone(mesh_shape=shape, axis_names=names))


class ScanLayersModifier(ConfigModifier):
    """Runs the transformer stack under lax.scan with a remat policy (fast compile, less memory)."""

    @config_class
    class Config(ConfigModifier.Config):
        remat_policy: str = "none"

    def __call__(self, cfg: ConfigBase) -> ConfigBase:
        from axplug.layers import RepeatedTransformer, StackedTransformer

        new = RepeatedTransformer.default_config().set(remat_policy=self._config.remat_policy)
        if find_configs(cfg, RepeatedTransformer):
            return replace_config(cfg, target=RepeatedTransformer, new_cfg=new, carry=["layer"])
        return replace_config(cfg, target=StackedTransformer, new_cfg=new)


class PipelineModifier(ConfigModifier):
    """Runs the layer stack as pipeline stages, e.g. `pipeline:stages=4,microbatches=8`.

    `schedule`: `gpipe`; `circular` with `repeats` virtual stages per device (a smaller
    bubble); `1f1b` (activation memory bounded by the stages, not the microbatches). Put the
    stages on devices with `mesh:pipeline=<stages>`. The parameters keep the scanned stack's
    tree, so checkpoints move between pipelined and scanned runs.
    """

    @config_class
    class Config(ConfigModifier.Config):
        stages: int = 2
        microbatches: int = 4
        schedule: str = "gpipe"
        repeats: int = 2
        remat_policy: str | None = None  # None: keep the stack's

    def __call__(self, cfg: ConfigBase) -> ConfigBase:
        from axplug.layers import PipelinedTransformer, RepeatedTransformer, StackedTransformer

        c = self._config
        new = PipelinedTransformer.default_config().set(
            num_stages=c.stages,
            num_microbatches=c.microbatches,
            schedule=c.schedule,
            num_repeats=c.repeats,
        )
        owned = ["num_stages", "num_microbatches", "schedule", "num_repeats"]
        if c.remat_policy is not None:
            new.remat_policy = c.remat_policy
            owned.append("remat_policy")
        for target in (PipelinedTransformer, RepeatedTransformer):
            if find_configs(cfg, target):
                return replace_config(cfg, target=target, new_cfg=new, carry=["layer"], owned=owned)
        return replace_config(cfg, target=StackedTransformer, new_cfg=new, owned=owned)


class QuantizeModifier(ConfigModifier):
    """Quantized matmuls in the layers' projections: `quantize:int8`, `quantize:fp8`, or
    `quantize:none` (back to float).

    int8: dynamic per-token x per-channel scales, int32 accumulation, int8 gradient matmuls
    unless `int8_backward=false`. fp8: e4m3 inputs and weights, e5m2 gradients, delayed
    scaling from `amax_history_length`-step histories. `targets` names the sub-layers whose
    Linear layers are quantized (path components; MoE experts and the LM head stay float).
    """

    positional_option = "mode"

    @config_class
    class Config(ConfigModifier.Config):
        mode: str | None = "int8"  # None or "none": float
        targets: tuple[str, ...] = ("attention", "feed_forward")
        int8_backward: bool = True
        amax_history_length: int = 16

    def __call__(self, cfg: ConfigBase) -> ConfigBase:
        from axplug.layers import Linear, PipelinedTransformer, QuantizedLinear
        from axplug.layers.quantized import QUANTIZE_MODES

        c = self._config
        mode = "none" if c.mode is None else c.mode
        if mode not in (*QUANTIZE_MODES, "none"):
            raise ConfigError(
                f"modifier quantize: unknown mode {mode!r}; choose from {[*QUANTIZE_MODES, 'none']}"
            )
        if mode == "fp8" and find_configs(cfg, PipelinedTransformer):
            raise ConfigError(
                "modifier quantize: fp8 amax histories are not kept per microbatch in a "
                "pipelined stack; use quantize:int8 or no `pipeline` modifier"
            )
        targets = set(c.targets)

        def under_targets(path, _old):
            return bool(targets & set(path.split(".")))

        # Back to float first, so re-applying with other options replaces them all.
        cfg = replace_config(
            cfg, target=QuantizedLinear, new_cfg=Linear.default_config(), missing_ok=True
        )
        if mode == "none":
            return cfg
        new = QuantizedLinear.default_config().set(
            mode=mode, int8_backward=c.int8_backward, amax_history_length=c.amax_history_length
        )
        return replace_config(cfg, target=Linear, new_cfg=new, where=under_targets)


class ComputeDtypeModifier(ConfigModifier):
    """Computes in `dtype` (e.g. bfloat16) while parameters stay in their storage dtype."""

    @config_class
    class Config(ConfigModifier.Config):
        dtype: str = "bfloat16"

    def __call__(self, cfg: ConfigBase) -> ConfigBase:
        return cfg.clone(model=cfg.model.clone(compute_dtype=self._config.dtype))


class PagedKVCacheModifier(ConfigModifier):
    """Decodes with a paged KV cache (fixed-size pages and a block table) in every attention."""

    @config_class
    class Config(ConfigModifier.Config):
        page_size: int = 16
        num_pages: int | None = None  # None: enough for every cache row to reach max_len

    def __call__(self, cfg: ConfigBase) -> ConfigBase:
        from axplug.layers import ContiguousKVCache, PagedKVCache

        new = PagedKVCache.default_config().set(
            page_size=self._config.page_size, num_pages=self._config.num_pages
        )
        return replace_config(cfg, target=ContiguousKVCache, new_cfg=new)
