"""Presets: a base trainer config plus the *names* of the modifiers that complete it."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from axplug.config import ConfigError, apply_overrides
from axplug.layers import (
    CausalLM,
    FeedForward,
    LayerNorm,
    RepeatedTransformer,
    StackedTransformer,
)
from axplug.trainer import Trainer

__all__ = ["Preset", "resolve_preset", "preset_config", "PRESETS"]


@dataclasses.dataclass(frozen=True)
class Preset:
    """`build()` gives the base config; `modifiers` are registered modifier specs applied in
    order; `providers` names the distribution that provides each plugin modifier;
    `config_json` is the published config.json a model's planning preset is built from."""

    name: str
    description: str
    build: Callable[[], Trainer.Config]
    modifiers: tuple[str, ...] = ()
    providers: Mapping[str, str] = dataclasses.field(default_factory=dict)
    config_json: Mapping[str, Any] | None = None


_ATTENTION, _MOE = "axplug-attention", "axplug-moe"


def _lm(
    *,
    vocab,
    dim,
    layers,
    heads,
    hidden,
    scan=False,
    gated=True,
    activation="silu",
    norm=None,
    tie=False,
) -> CausalLM.Config:
    cfg = CausalLM.default_config()
    decoder = cfg.decoder.set(vocab_size=vocab, dim=dim, tie_word_embeddings=tie)
    stack = RepeatedTransformer if scan else StackedTransformer
    decoder.transformer = stack.default_config().set(num_layers=layers)
    if scan:
        decoder.transformer.remat_policy = "full"
    layer = decoder.transformer.layer
    layer.attention.set(num_heads=heads)
    layer.feed_forward = FeedForward.default_config().set(
        hidden_dim=hidden, gated=gated, activation=activation
    )
    if norm is not None:
        layer.norm = norm
        decoder.output_norm = norm.clone()
    return cfg


def _trainer(model, *, seq_len, batch_size, lr, steps, warmup) -> Trainer.Config:
    cfg = Trainer.default_config().set(model=model, max_steps=steps, output_dir="runs/default")
    cfg.input.set(seq_len=seq_len, batch_size=batch_size)
    cfg.learner.set(learning_rate=lr, warmup_steps=warmup, schedule="cosine")
    return cfg


def _gpt_tiny() -> Trainer.Config:
    model = _lm(
        vocab=256,
        dim=128,
        layers=2,
        heads=4,
        hidden=512,
        gated=False,
        activation="gelu",
        norm=LayerNorm.default_config(),
    )
    return _trainer(model, seq_len=128, batch_size=8, lr=3e-3, steps=100, warmup=10)


def _llama_tiny() -> Trainer.Config:
    model = _lm(vocab=256, dim=256, layers=4, heads=8, hidden=704)
    return _trainer(model, seq_len=256, batch_size=8, lr=2e-3, steps=300, warmup=20)


def _full(vocab, dim, layers, heads, hidden, seq_len=4096) -> Callable[[], Trainer.Config]:
    def build() -> Trainer.Config:
        model = _lm(vocab=vocab, dim=dim, layers=layers, heads=heads, hidden=hidden, scan=True)
        model.compute_dtype = "bfloat16"
        return _trainer(model, seq_len=seq_len, batch_size=256, lr=3e-4, steps=100_000, warmup=2000)

    return build


gpt_tiny = Preset(
    "gpt-tiny", "2-layer GPT on bytes, core layers only (trains in seconds)", _gpt_tiny
)
llama_tiny = Preset(
    "llama-tiny",
    "4-layer LLaMA recipe on bytes (RMSNorm, SwiGLU, RoPE); trains on CPU in minutes",
    _llama_tiny,
    ("rope",),
    {"rope": _ATTENTION},
)
llama2_7b = Preset(
    "llama2-7b",
    "LLaMA 2 7B shapes, for planning and AOT checks",
    _full(32000, 4096, 32, 32, 11008),
    ("rope",),
    {"rope": _ATTENTION},
)
llama2_70b = Preset(
    "llama2-70b",
    "LLaMA 2 70B shapes (GQA, 8 kv heads)",
    _full(32000, 8192, 80, 64, 28672),
    ("rope", "gqa:num_kv_heads=8"),
    {"rope": _ATTENTION, "gqa": _ATTENTION},
)
llama3_8b = Preset(
    "llama3-8b",
    "LLaMA 3 8B shapes (GQA, rope theta 500k, 128k vocab)",
    _full(128256, 4096, 32, 32, 14336, seq_len=8192),
    ("rope:theta=500000.0", "gqa:num_kv_heads=8"),
    {"rope": _ATTENTION, "gqa": _ATTENTION},
)
mixtral_8x7b = Preset(
    "mixtral-8x7b",
    "Mixtral 8x7B shapes (8 experts, top-2, GQA)",
    _full(32000, 4096, 32, 32, 14336),
    ("rope:theta=1000000.0", "gqa:num_kv_heads=8", "moe:num_experts=8,top_k=2"),
    {"rope": _ATTENTION, "gqa": _ATTENTION, "moe": _MOE},
)

PRESETS = (gpt_tiny, llama_tiny, llama2_7b, llama2_70b, llama3_8b, mixtral_8x7b)


def resolve_preset(name: str) -> Preset:
    """The registered preset `name`, or a `module:function` (your own recipe, importable)
    returning a Preset or a Trainer config; else an error listing the installed presets."""
    import re

    from axplug import registry

    try:
        preset = registry.load("presets", name)
    except registry.ComponentNotFoundError:
        if not re.fullmatch(r"[A-Za-z_][\w.]*:[A-Za-z_][\w.]*", name):
            raise
        preset = _recipe(name)
    if not isinstance(preset, Preset):
        raise ConfigError(f"preset {name!r} is a {type(preset).__qualname__}, not a Preset")
    return preset


def _recipe(name: str) -> Preset:
    """`module:function` -> a Preset: what it returns (a Preset, or a Trainer config)."""
    from axplug.input.iterator import resolve_function

    try:
        made = resolve_function(name)
    except ValueError as e:
        raise ConfigError(f"--preset {name!r}: {e}") from None
    made = made if isinstance(made, Preset) else made()
    if isinstance(made, Preset):
        return made
    if isinstance(made, Trainer.Config):
        return Preset(name, f"the recipe {name}", lambda: made.clone())
    raise ConfigError(
        f"--preset {name!r} returned a {type(made).__qualname__}; a recipe function returns "
        "an axplug.presets.Preset or a Trainer config"
    )


def _check_modifiers(preset: Preset, specs: Sequence[str]) -> None:
    from axplug import registry
    from axplug.modifiers import parse_modifier_spec

    for spec in specs:
        name, _ = parse_modifier_spec(spec)
        if name not in preset.providers and (head := name.rpartition(":")[0]) in preset.providers:
            name = head  # `quantize:int8` of a modifier not loadable here reads as `dist:name`
        try:
            component = registry.entry("modifiers", name)
        except registry.ComponentConflictError as exc:
            raise ConfigError(f"preset {preset.name} needs modifier {name!r}: {exc}") from None
        except LookupError:
            package = preset.providers.get(name)
            hint = f": pip install {package}" if package else "; see `axplug list --kind modifiers`"
            raise ConfigError(f"preset {preset.name} needs modifier {name!r}{hint}") from None
        if not component.loadable:
            raise ConfigError(
                f"preset {preset.name} needs modifier {name!r} from {component.distribution}, "
                f"which is {component.status}: {component.reason}"
            )


def preset_config(
    name: str,
    *,
    modifiers: Sequence[str] = (),
    overrides: Sequence[str] = (),
) -> Trainer.Config:
    """The preset's config with its modifiers, then `modifiers`, then `overrides` applied.

    Every modifier is checked to be installed before any is applied.
    """
    from axplug.modifiers import make_modifier

    preset = resolve_preset(name)
    specs = (*preset.modifiers, *modifiers)
    _check_modifiers(preset, specs)
    cfg = preset.build()
    for spec in specs:
        cfg = make_modifier(spec)(cfg)
    return apply_overrides(cfg, overrides)
