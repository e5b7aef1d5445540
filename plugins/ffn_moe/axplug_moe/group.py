"""A block of `every` transformer layers whose last one is MoE: the repeated unit of a stack
that has a mixture-of-experts feed-forward in every Nth layer; and a stack whose first
layers are dense, unrolled or (`scan_layers`) with the layers after them scanned."""

from __future__ import annotations

from typing import Any

import jax

from axplug.api.config import REQUIRED, ConfigError, Required, config_class
from axplug.api.layers import (
    REMAT_POLICIES,
    BaseLayer,
    RepeatedTransformer,
    StackedTransformer,
    TransformerLayer,
    remat_children,
)

__all__ = ["MoELayerGroup", "DenseFirstStack", "RepeatedDenseFirstStack"]


class MoELayerGroup(BaseLayer):
    """Children layer0..layer{every-2} from `layer`, then layer{every-1} from `moe_layer`,
    applied in order. As the `layer` of `StackedTransformer` (unrolled) or
    `RepeatedTransformer` (scanned, one group per scan step) it gives `every`-periodic
    stacks without a new stack class: the stack's `num_layers` counts groups."""

    @config_class
    class Config(BaseLayer.Config):
        input_dim: Required[int] = REQUIRED
        every: int = 2
        layer: BaseLayer.Config = TransformerLayer.default_config()
        moe_layer: BaseLayer.Config = TransformerLayer.default_config()

    @classmethod
    def hf_depth(cls, cfg: Config) -> int:
        """The Hugging Face layers one group is (a stack's num_hidden_layers counts them)."""
        return cfg.every

    def __init__(self, cfg: Config, *, parent=None):
        super().__init__(cfg, parent=parent)
        if cfg.every < 1:
            raise ConfigError(f"{self.path}.every: {cfg.every} must be >= 1")
        for i in range(cfg.every):
            sub = cfg.moe_layer if i == cfg.every - 1 else cfg.layer
            self._add_child(f"layer{i}", sub.clone(input_dim=cfg.input_dim))

    def forward(self, x: jax.Array, **kwargs: Any) -> jax.Array:
        for i in range(self._config.every):
            x = getattr(self, f"layer{i}")(x, **kwargs)
        return x

    def init_cache_state(self, batch_size: int, max_len: int) -> dict:
        """An empty decoding cache per layer of the group."""
        return {
            f"layer{i}": getattr(self, f"layer{i}").init_cache_state(batch_size, max_len)
            for i in range(self._config.every)
        }

    def extend_step(self, x: jax.Array, *, positions: jax.Array, cache_state: dict):
        """`forward` for new tokens through each layer's cache; (output, new cache)."""
        new_cache = {}
        for i in range(self._config.every):
            name = f"layer{i}"
            x, new_cache[name] = getattr(self, name).extend_step(
                x, positions=positions, cache_state=cache_state[name]
            )
        return x, new_cache


class DenseFirstStack(StackedTransformer):
    """An unrolled stack whose first `num_dense_layers` layers are built from `dense_layer`
    and the rest from `layer`: DeepSeek's dense layers before the MoE ones
    (`first_k_dense_replace`). Children layer0..layerN-1 as in `StackedTransformer`."""

    @config_class
    class Config(StackedTransformer.Config):
        num_dense_layers: int = 0
        dense_layer: BaseLayer.Config = TransformerLayer.default_config()

    @classmethod
    def hf_read(cls, cfg: Any, fields) -> None:
        super().hf_read(cfg, fields)
        dense = fields.get("first_k_dense_replace", 0)
        if isinstance(dense, bool) or not isinstance(dense, int) or dense < 0:
            fields.problem(f"first_k_dense_replace={dense!r} (expected an integer >= 0)")
            dense = 0
        cfg.num_dense_layers = min(dense, cfg.num_layers)  # transformers: more is all dense

    @classmethod
    def hf_write(cls, cfg: Any) -> dict:
        return {**super().hf_write(cfg), "first_k_dense_replace": cfg.num_dense_layers}

    @classmethod
    def scanned_config(cls, cfg: Config, *, remat_policy: str) -> Any:
        """The scanned form (`scan_layers`): a `RepeatedDenseFirstStack` of the same layers."""
        return RepeatedDenseFirstStack.default_config().set(
            input_dim=cfg.input_dim,
            num_layers=cfg.num_layers,
            num_dense_layers=cfg.num_dense_layers,
            dense_layer=cfg.dense_layer.clone(),
            layer=cfg.layer.clone(),
            remat_policy=remat_policy,
        )

    def __init__(self, cfg: Config, *, parent=None):
        BaseLayer.__init__(self, cfg, parent=parent)  # children of its own, not the parent's
        if not 0 <= cfg.num_dense_layers <= cfg.num_layers:
            raise ConfigError(
                f"{self.path}.num_dense_layers: {cfg.num_dense_layers} must be between 0 and "
                f"num_layers ({cfg.num_layers})"
            )
        for i in range(cfg.num_layers):
            sub = cfg.dense_layer if i < cfg.num_dense_layers else cfg.layer
            self._add_child(f"layer{i}", sub.clone(input_dim=cfg.input_dim))


class RepeatedDenseFirstStack(BaseLayer):
    """`DenseFirstStack`'s layers with the ones after the dense layers scanned: children
    `dense{i}` (the first `num_dense_layers`, unrolled, each under jax.checkpoint with
    `remat_policy`) and `layer`, a `RepeatedTransformer` of the rest. DeepSeek-V3's 3 dense
    layers then 58 MoE layers compile as 3 + 1."""

    @config_class
    class Config(BaseLayer.Config):
        input_dim: Required[int] = REQUIRED
        num_layers: Required[int] = REQUIRED  # every layer, the dense ones included
        num_dense_layers: int = 0
        dense_layer: BaseLayer.Config = TransformerLayer.default_config()
        layer: BaseLayer.Config = TransformerLayer.default_config()
        remat_policy: str = "none"

    hf_role = "stack"  # computes what the unrolled DenseFirstStack computes
    hf_read = DenseFirstStack.hf_read
    hf_write = DenseFirstStack.hf_write

    @classmethod
    def scanned_config(cls, cfg: Config, *, remat_policy: str) -> Config:
        """`scan_layers` applied again: the same stack with the new remat policy."""
        return cfg.clone(remat_policy=remat_policy)

    @classmethod
    def hf_layer_path(cls, cfg: Config, i: int) -> str:
        """Layer i's parameters below the stack; a scanned layer j spelled `layer{j}.layer`
        (the core fills it into, and exports it from, the stacked arrays)."""
        k = cfg.num_dense_layers
        return f"dense{i}" if i < k else f"layer{i - k}.layer"

    def __init__(self, cfg: Config, *, parent=None):
        super().__init__(cfg, parent=parent)
        if not 0 <= cfg.num_dense_layers <= cfg.num_layers:
            raise cfg.field_error(
                "num_dense_layers",
                f"{cfg.num_dense_layers} must be between 0 and num_layers ({cfg.num_layers})",
            )
        if cfg.remat_policy not in REMAT_POLICIES:
            raise cfg.field_error(
                "remat_policy",
                f"unknown policy {cfg.remat_policy!r}; choose from {sorted(REMAT_POLICIES)}",
            )
        for i in range(cfg.num_dense_layers):
            self._add_child(f"dense{i}", cfg.dense_layer.clone(input_dim=cfg.input_dim))
        if self._num_scanned:
            scan = RepeatedTransformer.default_config().set(
                input_dim=cfg.input_dim,
                num_layers=self._num_scanned,
                layer=cfg.layer.clone(),
                remat_policy=cfg.remat_policy,
            )
            self._add_child("layer", scan)

    @property
    def _num_scanned(self) -> int:
        return self._config.num_layers - self._config.num_dense_layers

    def forward(self, x: jax.Array, **kwargs: Any) -> jax.Array:
        cfg = self._config
        dense = [f"dense{i}" for i in range(cfg.num_dense_layers)]
        x = remat_children(self, dense, x, kwargs, cfg.remat_policy)
        return self.layer(x, **kwargs) if self._num_scanned else x

    def init_cache_state(self, batch_size: int, max_len: int) -> dict:
        """The dense layers' caches and the scanned layers' (stacked)."""
        out = {
            f"dense{i}": getattr(self, f"dense{i}").init_cache_state(batch_size, max_len)
            for i in range(self._config.num_dense_layers)
        }
        if self._num_scanned:
            out["layer"] = self.layer.init_cache_state(batch_size, max_len)
        return out

    def extend_step(self, x: jax.Array, *, positions: jax.Array, cache_state: dict):
        """`forward` for new tokens through every layer's cache; (output, new cache)."""
        new = {}
        names = [f"dense{i}" for i in range(self._config.num_dense_layers)]
        for name in names + (["layer"] if self._num_scanned else []):
            x, new[name] = getattr(self, name).extend_step(
                x, positions=positions, cache_state=cache_state[name]
            )
        return x, new
