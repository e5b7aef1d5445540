"""Grouped-query attention: fewer key/value heads than query heads (1: multi-query)."""

from __future__ import annotations

from typing import Any

from axplug.api.config import REQUIRED, ConfigError, Required, config_class
from axplug.api.layers import QKVLinear

__all__ = ["GroupedQKVLinear"]


class GroupedQKVLinear(QKVLinear):
    """QKV projection with `num_kv_heads` k/v heads, each shared by num_heads // num_kv_heads
    query heads; the kernels take k/v with fewer heads as they are."""

    @config_class
    class Config(QKVLinear.Config):
        num_kv_heads: Required[int] = REQUIRED

    @classmethod
    def hf_read(cls, cfg: Any, fields) -> None:
        cfg.bias = bool(fields.get("qkv_bias", fields.get("attention_bias", False)))
        cfg.linear.bias = False  # `bias` says it (one field, so export compares one)
        heads = fields.positive_int("num_attention_heads")
        kv_heads = fields.positive_int("num_key_value_heads", heads)
        if heads and kv_heads and heads % kv_heads:
            fields.problem(
                f"num_key_value_heads={kv_heads} does not divide num_attention_heads={heads}"
            )
        cfg.num_kv_heads = kv_heads

    @classmethod
    def hf_write(cls, cfg: Any) -> dict:
        bias = bool(cfg.bias or cfg.linear.bias)
        return {"qkv_bias": bias, "num_key_value_heads": cfg.num_kv_heads}

    def __init__(self, cfg: Config, *, parent=None):
        # Checked before the projections are built, so the error names the field.
        if cfg.num_kv_heads < 1 or cfg.num_heads % cfg.num_kv_heads:
            path = f"{parent.path}.{cfg.name}" if parent is not None else (cfg.name or "model")
            raise ConfigError(
                f"{path}.num_kv_heads: {cfg.num_kv_heads} must divide num_heads ({cfg.num_heads})"
            )
        super().__init__(cfg, parent=parent)

    @property
    def num_kv_heads(self) -> int:
        return self._config.num_kv_heads
