"""A transformer stack whose layers differ by kind: Gemma 2's alternating sliding and full
attention, Gemma 3's five sliding layers to one full, each kind with its own RoPE.

`PatternedTransformer` is `StackedTransformer` (children layer0..layerN-1, the same parameter
tree, so the LLaMA tensor naming applies) whose layer i is the `layer` template with the
overrides of its kind `pattern[i]` applied: `kinds` maps a kind name to {dotted path inside
the layer config: value}, e.g.

    pattern = ("sliding_attention", "full_attention") * 13
    kinds = {
        "sliding_attention": {"attention.sliding_window": 4096,
                              "attention.position.theta": 10000.0},
        "full_attention": {"attention.sliding_window": None},
    }

Scanned: `scan_layers` (`scanned_config`) turns it into `RepeatedPatternTransformer`
(pattern_scan.py): one period of the pattern under lax.scan, the layers after the last whole
period unrolled, each layer under jax.checkpoint with `remat_policy` (which this unrolled
stack honours too).

Hugging Face: `hf_read` sets the pattern from `layer_types` (absent: derived from
`sliding_window_pattern` as transformers does: layer i is full when (i + 1) % period == 0; a
family whose config.json has neither gives the period in its `defaults`, Gemma 2: 2,
Gemma 3: 6) and the kinds from `sliding_window` and the sliding layers' RoPE
(`rope_local_base_freq`, or the `sliding_attention` entry of a `rope_parameters` keyed by
layer type). The layer template is read after the stack, from the fields every layer shares
(its RoPE from `rope_theta` / `rope_scaling` / the `full_attention` entry); the kinds' overrides
are applied over it when the layers are built, so they win. `hf_write` writes the fields of
every kind's layers itself (`hf_writes_subtree`) and refuses overrides config.json cannot
express.
"""

from __future__ import annotations

import copy
import difflib
from collections.abc import Mapping
from typing import Any

from axplug_attention.rope_hf import LAYER_TYPES, per_layer_type, read_rope

from axplug.api import HFFields
from axplug.api.config import (
    REQUIRED,
    ConfigBase,
    ConfigError,
    ConfigTypeError,
    Required,
    UnknownFieldError,
    config_class,
)
from axplug.api.interop import differences, write_fields
from axplug.api.layers import REMAT_POLICIES, BaseLayer, StackedTransformer, remat_children

__all__ = ["PatternedTransformer", "apply_layer_overrides", "layer_types_from"]

SLIDING, FULL = "sliding_attention", "full_attention"
_WINDOW = "attention.sliding_window"
_POSITION = "attention.position."
# RotaryPositionTransform's config.json fields, written per kind as a keyed rope_parameters.
_ROPE_KEYS = ("rope_theta", "rope_scaling", "rope_parameters")


def apply_layer_overrides(
    layer: BaseLayer.Config, overrides: Mapping[str, Any], where: str
) -> BaseLayer.Config:
    """A copy of `layer` with each `{dotted path: value}` of `overrides` set; an unknown path
    or a value of the wrong type raises a ConfigError naming `where[path]`."""
    new = layer.clone()
    for path, value in overrides.items():
        node: Any = new
        parts = path.split(".")
        for i, part in enumerate(parts):
            inside = ".".join(parts[:i]) or "the layer config"
            if not isinstance(node, ConfigBase):
                raise ConfigError(
                    f"{where}[{path!r}]: {inside} is {node!r}, not a config with fields"
                )
            names = node.keys()
            if part not in names:
                close = difflib.get_close_matches(part, names, n=1, cutoff=0.6)
                hint = f", did you mean {close[0]!r}?" if close else f" (fields: {names})"
                raise UnknownFieldError(
                    f"{where}[{path!r}]: {inside} ({type(node).__qualname__}) has no field "
                    f"{part!r}{hint}"
                )
            if i < len(parts) - 1:
                node = getattr(node, part)
        try:
            setattr(node, parts[-1], copy.deepcopy(value))
        except ConfigTypeError as exc:
            raise ConfigTypeError(f"{where}[{path!r}]: {exc}") from None
    return new


def _known_kinds(cfg: Any) -> str:
    return ", ".join(repr(k) for k in cfg.kinds) or "none"


def _check(cfg: Any) -> None:
    """The pattern against num_layers and kinds, and the remat policy; errors name the
    config path."""
    if cfg.remat_policy not in REMAT_POLICIES:
        raise cfg.field_error(
            "remat_policy",
            f"unknown policy {cfg.remat_policy!r}; choose from {sorted(REMAT_POLICIES)}",
        )
    pattern = tuple(cfg.pattern)
    if len(pattern) != cfg.num_layers:
        raise cfg.field_error(
            "pattern",
            f"{len(pattern)} kind(s) for num_layers={cfg.num_layers}; give one kind per layer",
        )
    for i, kind in enumerate(pattern):
        if kind not in cfg.kinds:
            raise cfg.field_error(
                "pattern",
                f"layer {i} has kind {kind!r}, which `kinds` does not define (defined: "
                f"{_known_kinds(cfg)}; a kind without overrides is an empty dict)",
            )


def _layer(cfg: Any, kind: str) -> BaseLayer.Config:
    return apply_layer_overrides(cfg.layer, cfg.kinds[kind], f"{cfg.field_path('kinds')}[{kind!r}]")


def layer_types_from(fields: HFFields, num_layers: int) -> list[str] | None:
    """The kind of every layer: `layer_types`, else derived from `sliding_window_pattern` as
    transformers does (Gemma 2 and 3); None after recording the problem."""
    types = fields.get("layer_types", None)
    # Read either way (layer_types wins); transformers 5 keeps the period as
    # `_sliding_window_pattern`, published Gemma 3 configs spell it without the underscore.
    name = "_sliding_window_pattern"
    if fields.get(name, None) is None:
        name = "sliding_window_pattern"
    period = fields.get(name, None)
    if types is None:
        if period is None:
            fields.problem(
                "missing layer_types (and no sliding_window_pattern to derive them from)"
            )
            return None
        period = fields.positive_int(name)
        if not period:
            return None
        return [SLIDING if (i + 1) % period else FULL for i in range(num_layers)]
    if not isinstance(types, list) or any(t not in LAYER_TYPES for t in types):
        fields.problem(
            f"layer_types={types!r} (expected a list of {' / '.join(map(repr, LAYER_TYPES))})"
        )
        return None
    if num_layers and len(types) != num_layers:
        fields.problem(f"layer_types has {len(types)} entries for num_hidden_layers={num_layers}")
        return None
    return types


def _has_path(cfg: Any, path: str) -> bool:
    node = cfg
    for part in path.split("."):
        names = node.keys() if isinstance(node, ConfigBase) else []
        if part not in names:
            return False
        node = getattr(node, part)
    return True


def _sliding_rope(cfg: Any, fields: HFFields) -> dict[str, Any]:
    """The sliding layers' RoPE overrides: from a `rope_parameters` keyed by layer type (its
    `sliding_attention` entry) or `rope_local_base_freq` (the transformers 4 form); {} when
    neither is set (Gemma 2: one RoPE for every layer)."""
    local = fields.get("rope_local_base_freq", None)
    keyed = per_layer_type(fields.raw.get(fields.name("rope_parameters")))
    if keyed:
        fields.get("rope_parameters")  # read here, so the template takes the full entry
    if not keyed and local is None:
        return {}
    if not _has_path(cfg.layer, _POSITION + "theta"):
        fields.problem(
            "the sliding layers have their own RoPE (rope_local_base_freq or rope_parameters "
            "per layer type), but the layer template's attention.position is not RoPE"
        )
        return {}
    if keyed:
        rope = read_rope(fields, SLIDING, theta_field="rope_local_base_freq")
    else:
        rope = {
            "theta": fields.number("rope_local_base_freq"),
            "scaling_factor": None,
            "linear_scaling_factor": None,
        }
    return {_POSITION + k: v for k, v in rope.items()}


class PatternedTransformer(StackedTransformer):
    """`num_layers` children layer0..layerN-1 applied in order (StackedTransformer's tree),
    layer i being `layer` with the overrides `kinds[pattern[i]]` applied."""

    @config_class
    class Config(StackedTransformer.Config):
        # One kind name per layer, e.g. ("sliding_attention", "full_attention") * 13.
        pattern: Required[tuple[str, ...]] = REQUIRED
        # kind -> {dotted path inside the layer config: value}, e.g.
        # {"sliding_attention": {"attention.sliding_window": 4096}}; {} overrides nothing.
        kinds: dict[str, dict[str, Any]] = {}
        # Each layer under jax.checkpoint with this policy (REMAT_POLICIES); the scanned form
        # (`scan_layers`) sets it on the periods it scans.
        remat_policy: str = "none"

    hf_role = "stack"  # computes what a stack of its layers computes
    hf_writes_subtree = True  # hf_write writes every kind's layers' fields
    _in_scan = False  # whether its layers' checkpoints run inside a scan (no CSE barrier)

    @classmethod
    def scanned_config(cls, cfg: Config, *, remat_policy: str) -> Any:
        """The scanned form (`scan_layers`): a `RepeatedPatternTransformer` of the same
        layers."""
        from axplug_models.pattern_scan import RepeatedPatternTransformer

        new = RepeatedPatternTransformer.default_config()
        for name, value in cfg.items():
            if name != "klass":
                setattr(new, name, copy.deepcopy(value))
        return new.set(remat_policy=remat_policy)

    @classmethod
    def hf_layer_path(cls, cfg: Config, i: int) -> str:
        """Layer i's parameters, below the stack."""
        return f"layer{i}"

    @classmethod
    def hf_read(cls, cfg: Any, fields) -> None:
        """num_layers, the pattern from `layer_types` and the kinds' sliding window and RoPE."""
        cfg.num_layers = n = fields.positive_int("num_hidden_layers")
        rope = _sliding_rope(cfg, fields)
        types = layer_types_from(fields, n)
        if types is None:
            return
        kinds: dict[str, dict[str, Any]] = {}
        if FULL in types:
            kinds[FULL] = {_WINDOW: None}
        if SLIDING in types:
            window = 0
            if fields.get("sliding_window", None) is None:
                fields.problem("layer_types has sliding_attention layers, but no sliding_window")
            else:
                window = fields.positive_int("sliding_window")
            kinds[SLIDING] = {_WINDOW: window, **rope}
        cfg.pattern = tuple(types)
        cfg.kinds = kinds

    @classmethod
    def hf_write(cls, cfg: Any) -> dict:
        """The fields of every kind's layers (equal across kinds, or per kind where
        config.json has a form for it: `sliding_window`, the RoPE), with `layer_types`."""
        try:
            _check(cfg)
            used = list(dict.fromkeys(cfg.pattern))
            layers = {kind: _layer(cfg, kind) for kind in used}
        except ConfigError as exc:
            raise ValueError(str(exc)) from None
        for kind in used:
            if kind not in LAYER_TYPES:
                raise ValueError(
                    f"kind {kind!r} is not a Hugging Face layer type "
                    f"({' or '.join(map(repr, LAYER_TYPES))})"
                )
        written: dict[str, dict] = {}
        for kind, layer in layers.items():
            written[kind], problems = write_fields(layer)
            if problems:  # named by their path in the layer config
                where = [p.replace("model.", "layer.", 1) for p in problems]
                raise ValueError(f"the {kind} layers: " + "; ".join(where))
            window = written[kind].get("sliding_window")
            if kind == SLIDING and window is None:
                raise ValueError("the sliding_attention layers have no sliding window")
            if kind == FULL and window is not None:
                raise ValueError(f"the full_attention layers have a sliding window ({window})")
        rope_overridden = any(p.startswith(_POSITION) for k in used for p in cfg.kinds[k])
        per_kind_rope = len(used) > 1 and (
            rope_overridden
            or any(written[FULL].get(k) != written[SLIDING].get(k) for k in _ROPE_KEYS)
        )
        out: dict[str, Any] = {
            "num_hidden_layers": cfg.num_layers,
            "layer_types": list(cfg.pattern),
        }
        keys = list(dict.fromkeys(k for kind in used for k in written[kind]))
        for key in keys:
            if key == "sliding_window":
                out[key] = written.get(SLIDING, written[used[0]]).get(key)
                continue
            if per_kind_rope and key in _ROPE_KEYS:
                continue
            values = {kind: written[kind].get(key) for kind in used}
            if len({repr(v) for v in values.values()}) > 1:
                raise ValueError(
                    f"the kinds' layers differ in {key} ({values}), which config.json has one "
                    "of for every layer"
                )
            out[key] = values[used[0]]
        if per_kind_rope:
            if not all("rope_parameters" in written[k] for k in used):
                raise ValueError("the kinds' position transforms differ, and are not RoPE")
            out["rope_parameters"] = {k: written[k]["rope_parameters"] for k in LAYER_TYPES}
            out["rope_theta"] = written[FULL]["rope_theta"]  # transformers 4: the global RoPE
            out["rope_scaling"] = written[FULL]["rope_scaling"]
        if SLIDING in used and any(p.startswith(_POSITION) for p in cfg.kinds[SLIDING]):
            if "rope_theta" not in written[SLIDING]:
                raise ValueError("the sliding_attention layers' position transform is not RoPE")
            out["rope_local_base_freq"] = written[SLIDING]["rope_theta"]  # transformers 4
        _check_round_trip(cls, cfg, out, layers)
        return out

    def __init__(self, cfg: Config, *, parent: Any = None):
        # StackedTransformer's fields and methods; its children built here, one per kind.
        super(StackedTransformer, self).__init__(cfg, parent=parent)
        _check(cfg)
        templates = {kind: _layer(cfg, kind) for kind in cfg.kinds}  # every kind checked
        for i, kind in enumerate(cfg.pattern):
            self._add_child(f"layer{i}", templates[kind].clone(input_dim=cfg.input_dim))

    def forward(self, x: Any, **kwargs: Any) -> Any:
        """The layers in order, each under jax.checkpoint unless remat_policy is "none"."""
        cfg = self._config
        names = [f"layer{i}" for i in range(cfg.num_layers)]
        return remat_children(
            self, names, x, kwargs, cfg.remat_policy, prevent_cse=not self._in_scan
        )

    def layer_config(self, i: int) -> BaseLayer.Config:
        """The config of layer i: the template with its kind's overrides."""
        return _layer(self._config, self._config.pattern[i])


def _check_round_trip(cls: Any, cfg: Any, out: dict, layers: dict) -> None:
    """Refuses what `out` would not read back to: an override no field expresses."""
    again = cfg.clone()
    fields = HFFields(out)
    cls.hf_read(again, fields)
    if fields.problems:
        raise ValueError("; ".join(fields.problems))
    for kind, layer in layers.items():
        diff = differences(layer, _layer(again, kind), path=f"the {kind} layers' config")
        if diff:
            raise ValueError(
                "config.json cannot express the kinds' overrides: "
                + "; ".join(d.replace("the architecture has", "config.json reads") for d in diff)
                + " (config.json gives the sliding layers their window and RoPE; the rest, the "
                "full_attention layers' RoPE included, is the layer template's)"
            )
