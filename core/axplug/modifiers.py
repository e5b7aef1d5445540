"""Modifier specs (`name:key=value,...`) and the core's own config modifiers."""

from __future__ import annotations

from typing import Any

from axplug.component_spec import component_config, resolve_spec
from axplug.config import (
    ConfigBase,
    ConfigModifier,
    InstantiableConfig,
    apply_overrides,
    config_class,
    configurable_class,
    find_configs,
    replace_config,
    visit,
)
from axplug.mesh import MESH_AXES, PIPELINE_AXIS

__all__ = [
    "parse_modifier_spec",
    "make_modifier",
    "SetModifier",
    "MeshShapeModifier",
    "ScanLayersModifier",
    "ComputeDtypeModifier",
    "PagedKVCacheModifier",
]


def parse_modifier_spec(spec: str) -> tuple[str, dict]:
    """`name:size=8,top_k=2` -> ("name", {...}); `my-dist:name` keeps its qualifier;
    `name:value` -> ("name", {first field: value})."""
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
    """Runs the transformer stack under lax.scan with a remat policy (fast compile, less memory).

    A stack class that scans otherwise (a plugin's stack of layers that differ) says how with a
    classmethod `scanned_config(cfg, *, remat_policy) -> config` (BaseLayer's: None): its
    configs are replaced by what that returns (applied again, the scanned class's own
    `scanned_config` updates it).
    """

    @config_class
    class Config(ConfigModifier.Config):
        remat_policy: str = "none"

    def __call__(self, cfg: ConfigBase) -> ConfigBase:
        from axplug.layers import RepeatedTransformer, StackedTransformer

        policy = self._config.remat_policy
        cfg, own = _scan_by_class(cfg, policy)
        new = RepeatedTransformer.default_config().set(remat_policy=policy)
        if find_configs(cfg, RepeatedTransformer):
            return replace_config(cfg, target=RepeatedTransformer, new_cfg=new, carry=["layer"])
        return replace_config(cfg, target=StackedTransformer, new_cfg=new, missing_ok=own > 0)


def _scan_by_class(cfg: ConfigBase, policy: str) -> tuple[ConfigBase, int]:
    """(`cfg` with every layer config whose class has a scanned form (`scanned_config`)
    replaced by it, how many were)."""
    from axplug.layers.base import BaseLayer

    found: list[tuple[str, InstantiableConfig, Any]] = []

    def add(path: str, value: object) -> None:
        klass = configurable_class(value)
        if klass is None or not issubclass(klass, BaseLayer):
            return
        if (new := klass.scanned_config(value, remat_policy=policy)) is not None:
            found.append((path, value, new))

    add("", cfg)
    visit(cfg, add)
    for path, old, new in found:
        cfg = replace_config(
            cfg,
            target=old.klass,  # type: ignore[arg-type]
            new_cfg=new,
            owned=list(new.keys()),  # what scanned_config returns is taken as it is
            where=lambda p, _old, path=path: p == path,
        )
    return cfg, len(found)


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
