"""The scanned form of `PatternedTransformer`: one period of the pattern under lax.scan, the
layers left over after the last whole period unrolled.

`scan_layers` turns a patterned stack into a `RepeatedPatternTransformer` with the same fields
(the layer template, `pattern`, `kinds`; `num_layers` still counts transformer layers) and
`remat_policy`; `period` (None: the pattern's shortest, Gemma 2: 2, Gemma 3: 6) is how many
layers one scan step runs. With R = num_layers // period and T = num_layers % period:

- `layer`: the core's `RepeatedTransformer` of R steps, each one period (a
  `PatternedTransformer` of the pattern's first `period` kinds); parameters and decode caches
  stacked on a leading `layers` axis, `layer.layer.layer{k}` holding position k of every
  period;
- `tail` (T > 0): the last T layers, unrolled: `tail.layer{j}` is layer R * period + j.
  Gemma 3's 26 layers are 4 periods of 6, then 2 sliding layers.

The tail is unrolled rather than padded into one more scan step: padding needs parameters
for layers the model does not have (no Hugging Face tensor to fill them, masked compute), and
the tail is never more than `period - 1` layers, so compile time stays flat in depth.

Remat is per transformer layer: each runs under jax.checkpoint with `remat_policy` and the
scan itself does not, so the backward pass holds one layer's activations at a time, as in a
scanned `RepeatedTransformer`, not a whole period's. config.json is read and written as for
`PatternedTransformer`; the tensor rules name layer i of step r as `layer{r}.layer.layer{k}`
below the stack (`hf_layer_path`), which the core fills into, and exports from, the stacked
arrays.
"""

from __future__ import annotations

import copy
from typing import Any

from axplug.api.config import REQUIRED, Required, config_class
from axplug.api.layers import BaseLayer, RepeatedTransformer, TransformerLayer
from axplug_models.pattern import PatternedTransformer, _check, _layer

__all__ = ["RepeatedPatternTransformer", "scan_period"]


def _first_break(pattern: tuple[str, ...], period: int) -> int | None:
    """The first layer whose kind is not that of the layer `period` before it, or None."""
    return next((i for i in range(period, len(pattern)) if pattern[i] != pattern[i - period]), None)


def scan_period(cfg: Any) -> int:
    """The layers one scan step runs: `cfg.period`, checked against the pattern, or the
    pattern's shortest period; errors name the config path."""
    pattern = tuple(cfg.pattern)
    if not pattern:
        raise cfg.field_error("num_layers", "0 layers; a scanned stack needs at least one")
    shortest = next(p for p in range(1, len(pattern) + 1) if _first_break(pattern, p) is None)
    period = cfg.period
    if period is None:
        return shortest
    if not 1 <= period <= len(pattern):
        raise cfg.field_error(
            "period",
            f"{period} is not between 1 and num_layers ({len(pattern)}); set None for the "
            f"pattern's shortest period ({shortest})",
        )
    i = _first_break(pattern, period)
    if i is not None:
        raise cfg.field_error(
            "period",
            f"the pattern does not repeat every {period} layers: layer {i} is {pattern[i]!r}, "
            f"layer {i - period} is {pattern[i - period]!r}; set a period it repeats with "
            f"(its shortest is {shortest}) or None",
        )
    return period


class _Period(PatternedTransformer):
    """One period of the pattern: one step of the scan."""

    _in_scan = True  # its layers' checkpoints run inside the stack's scan


def _unit(cfg: Any, klass: Any, pattern: tuple[str, ...]) -> Any:
    """A PatternedTransformer-like config of `klass` for `pattern`, from `cfg`'s layers."""
    return klass.default_config().set(
        input_dim=cfg.input_dim,
        num_layers=len(pattern),
        pattern=pattern,
        kinds=copy.deepcopy(cfg.kinds),
        layer=cfg.layer.clone(),
        remat_policy=cfg.remat_policy,
    )


class RepeatedPatternTransformer(BaseLayer):
    """`PatternedTransformer`'s layers, `period` at a time under lax.scan, the remainder
    unrolled after them (the module docstring has the tree)."""

    @config_class
    class Config(BaseLayer.Config):
        input_dim: Required[int] = REQUIRED
        num_layers: Required[int] = REQUIRED  # transformer layers, the tail's included
        layer: BaseLayer.Config = TransformerLayer.default_config()
        pattern: Required[tuple[str, ...]] = REQUIRED
        kinds: dict[str, dict[str, Any]] = {}
        remat_policy: str = "none"
        period: int | None = None  # layers per scan step; None: the pattern's shortest period

    hf_role = "stack"  # computes what the unrolled PatternedTransformer computes
    hf_writes_subtree = True
    hf_neutral = ("period",)  # how the layers are grouped, not what they compute

    @classmethod
    def hf_read(cls, cfg: Any, fields) -> None:
        """As PatternedTransformer: num_layers, the pattern and the kinds."""
        PatternedTransformer.hf_read(cfg, fields)

    @classmethod
    def hf_write(cls, cfg: Any) -> dict:
        """As PatternedTransformer: the fields of every kind's layers."""
        return PatternedTransformer.hf_write(cfg)

    @classmethod
    def scanned_config(cls, cfg: Config, *, remat_policy: str) -> Config:
        """`scan_layers` applied again: the same stack with the new remat policy."""
        return cfg.clone(remat_policy=remat_policy)

    @classmethod
    def hf_layer_path(cls, cfg: Config, i: int) -> str:
        """Layer i's parameters below the stack, a scan step r spelled `layer{r}`."""
        period = scan_period(cfg)
        step, k = divmod(i, period)
        if step < cfg.num_layers // period:
            return f"layer{step}.layer.layer{k}"
        return f"tail.layer{i - step * period}"

    def __init__(self, cfg: Config, *, parent: Any = None):
        super().__init__(cfg, parent=parent)
        _check(cfg)
        for kind in cfg.kinds:  # every kind's overrides, errors named by this config's path
            _layer(cfg, kind)
        period = scan_period(cfg)
        steps, rest = divmod(cfg.num_layers, period)
        pattern = tuple(cfg.pattern)
        scan = RepeatedTransformer.default_config().set(
            input_dim=cfg.input_dim,
            num_layers=steps,
            layer=_unit(cfg, _Period, pattern[:period]),
        )  # remat_policy "none": each layer of the period checkpoints itself
        self._add_child("layer", scan)
        if rest:
            self._add_child("tail", _unit(cfg, PatternedTransformer, pattern[steps * period :]))

    def forward(self, x: Any, **kwargs: Any) -> Any:
        x = self.layer(x, **kwargs)
        return self.tail(x, **kwargs) if "tail" in self.children else x

    def init_cache_state(self, batch_size: int, max_len: int) -> dict:
        """The scanned periods' caches (stacked) and the tail's."""
        out = {"layer": self.layer.init_cache_state(batch_size, max_len)}
        if "tail" in self.children:
            out["tail"] = self.tail.init_cache_state(batch_size, max_len)
        return out

    def extend_step(self, x: Any, *, positions: Any, cache_state: dict) -> tuple[Any, dict]:
        """`forward` for new tokens through the periods' and the tail's caches; (output, new
        cache)."""
        x, scanned = self.layer.extend_step(
            x, positions=positions, cache_state=cache_state["layer"]
        )
        new = {"layer": scanned}
        if "tail" in self.children:
            x, new["tail"] = self.tail.extend_step(
                x, positions=positions, cache_state=cache_state["tail"]
            )
        return x, new

    def layer_config(self, i: int) -> BaseLayer.Config:
        """The config of layer i: the template with its kind's overrides."""
        return _layer(self._config, self._config.pattern[i])
