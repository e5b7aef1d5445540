"""The `moe` modifier: `moe:num_experts=8,top_k=2,every=2,capacity_factor=1.25` turns the
dense feed-forward of every (or every Nth) transformer layer of any config tree into MoE."""

from __future__ import annotations

import copy

from axplug.api.config import (
    REQUIRED,
    ConfigBase,
    ConfigError,
    ConfigModifier,
    InstantiableConfig,
    config_class,
    find_configs,
    replace_config,
    visit,
)
from axplug.api.layers import FeedForward, RepeatedTransformer, StackedTransformer
from axplug_moe.dispatchers import DISPATCHERS
from axplug_moe.group import MoELayerGroup
from axplug_moe.layer import MoEFeedForward

__all__ = ["MoEModifier"]

_SLOT = "feed_forward"


def _in_slot(path: str, _cfg=None) -> bool:
    """Whether `path` is a transformer layer's feed-forward slot (not e.g. a shared expert)."""
    return path.rpartition(".")[2] == _SLOT


def _stacks(cfg: ConfigBase) -> list[tuple[str, InstantiableConfig]]:
    """Every (path, config) of a core transformer stack, unrolled or scanned."""
    found = []

    def check(path, value):
        klass = getattr(value, "klass", None)
        if isinstance(klass, type) and issubclass(klass, (StackedTransformer, RepeatedTransformer)):
            found.append((path, value))

    check("", cfg)
    visit(cfg, check)
    return found


def _set(moe: InstantiableConfig, fields: tuple[dict, dict]) -> InstantiableConfig:
    layer, router = copy.deepcopy(fields)
    moe.set(**layer)
    moe.router.set(**router)
    return moe


class MoEModifier(ConfigModifier):
    """Mixture of experts in the feed-forward slot of every `every`-th transformer layer.

    every=1 swaps each dense `FeedForward` for `MoEFeedForward` in place (dims, activation
    and gating carried over). every=N makes each stack's layer a `MoELayerGroup` of N layers
    (N-1 dense, then MoE) and divides its `num_layers` by N. Applied again, it updates the
    MoE layers it made (with the same `every`).
    """

    @config_class
    class Config(ConfigModifier.Config):
        num_experts: int = 8
        top_k: int = 2
        every: int = 1
        capacity_factor: float | None = 1.25  # None: drop-free
        renormalize: bool = True
        load_balance_coefficient: float = 0.01
        z_loss_coefficient: float = 1e-3
        num_shared_experts: int = 0
        shared_hidden_dim: int | None = None  # per shared expert; None: hidden_dim
        shared_expert_gate: bool = False  # sigmoid(x @ w) on the shared experts' output
        hidden_dim: int | None = None  # per expert; None: the dense layer's
        dispatch: str = "auto"

    def _fields(self) -> tuple[dict, dict]:
        """(fields of MoEFeedForward, fields of its router) this modifier sets."""
        c = self._config
        layer = dict(
            num_experts=c.num_experts,
            num_shared_experts=c.num_shared_experts,
            shared_hidden_dim=c.shared_hidden_dim,
            shared_expert_gate=c.shared_expert_gate,
            dispatch=DISPATCHERS[c.dispatch].default_config(),
        )
        if c.hidden_dim is not None:
            layer["hidden_dim"] = c.hidden_dim
        router = dict(
            top_k=c.top_k,
            capacity_factor=None if c.capacity_factor is None else float(c.capacity_factor),
            renormalize=c.renormalize,
            load_balance_coefficient=float(c.load_balance_coefficient),
            z_loss_coefficient=float(c.z_loss_coefficient),
        )
        return layer, router

    def _check(self) -> None:
        c = self._config
        if c.num_experts < 1:
            raise ConfigError(f"modifier 'moe': num_experts={c.num_experts} must be >= 1")
        if not 1 <= c.top_k <= c.num_experts:
            raise ConfigError(
                f"modifier 'moe': top_k={c.top_k} must be between 1 and num_experts={c.num_experts}"
            )
        if c.every < 1:
            raise ConfigError(f"modifier 'moe': every={c.every} must be >= 1")
        if c.capacity_factor is not None and c.capacity_factor <= 0:
            raise ConfigError(
                f"modifier 'moe': capacity_factor={c.capacity_factor} must be > 0 (None: drop-free)"
            )
        if c.shared_expert_gate and c.num_shared_experts < 1:
            raise ConfigError(
                "modifier 'moe': shared_expert_gate=True gates the shared experts; set "
                "num_shared_experts >= 1"
            )
        if c.dispatch not in DISPATCHERS:
            raise ConfigError(
                f"modifier 'moe': unknown dispatch {c.dispatch!r}; choose from "
                f"{', '.join(DISPATCHERS)}"
            )

    def __call__(self, cfg: ConfigBase) -> ConfigBase:
        self._check()
        fields = self._fields()
        if find_configs(cfg, MoEFeedForward):
            return self._update(cfg, fields)
        moe = _set(MoEFeedForward.default_config(), fields)
        every = self._config.every
        if every == 1:
            if not any(_in_slot(p) for p, _ in find_configs(cfg, FeedForward)):
                raise ConfigError(
                    "modifier 'moe': the config has no dense FeedForward in a feed_forward "
                    "slot to replace (axplug.layers.TransformerLayer.feed_forward)"
                )
            return replace_config(cfg, target=FeedForward, new_cfg=moe, where=_in_slot)
        cfg = copy.deepcopy(cfg)
        stacks = [
            (path, s)
            for path, s in _stacks(cfg)
            if any(_in_slot(p) for p, _ in find_configs(s.layer, FeedForward))
        ]
        if not stacks:
            raise ConfigError(
                f"modifier 'moe': every={every} needs a StackedTransformer or "
                "RepeatedTransformer whose layer has a dense feed_forward; use every=1 "
                "for other trees"
            )
        for path, stack in stacks:
            layers = stack.num_layers
            where = f"{path}.num_layers".lstrip(".")
            if layers is REQUIRED:
                raise ConfigError(f"modifier 'moe': set {where} before applying every={every}")
            if layers % every:
                raise ConfigError(f"modifier 'moe': every={every} must divide {where}={layers}")
            moe_layer = replace_config(stack.layer, target=FeedForward, new_cfg=moe, where=_in_slot)
            stack.layer = MoELayerGroup.default_config().set(
                every=every, layer=stack.layer, moe_layer=moe_layer
            )
            stack.num_layers = layers // every
        return cfg

    def _update(self, cfg: ConfigBase, fields: tuple[dict, dict]) -> ConfigBase:
        """A second application: same layout, new MoE fields."""
        every = self._config.every
        groups = find_configs(cfg, MoELayerGroup)
        have = sorted({g.every for _, g in groups}) if groups else [1]
        if have != [every]:
            raise ConfigError(
                f"modifier 'moe': already applied with every={have[0]}; cannot change it "
                f"to every={every} (start from the dense config)"
            )
        cfg = copy.deepcopy(cfg)
        for _, moe in find_configs(cfg, MoEFeedForward):
            _set(moe, fields)
        return cfg
