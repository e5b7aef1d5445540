"""Presets: a base trainer config plus the *names* of the modifiers that complete it."""

from __future__ import annotations

import dataclasses
import re
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

__all__ = [
    "Preset",
    "resolve_preset",
    "preset_config",
    "causal_lm_config",
    "trainer_config",
    "gpt_tiny",
]


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


def causal_lm_config(
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
    """A decoder-only LM of core layers: RMSNorm (or `norm`), a gated `activation` MLP (or
    not), a scanned stack (rematerialized) or an unrolled one; what a preset builds on."""
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


def trainer_config(model, *, seq_len, batch_size, lr, steps, warmup) -> Trainer.Config:
    """A trainer of `model` on `batch_size` x `seq_len` tokens, cosine learning rate with
    linear warmup."""
    cfg = Trainer.default_config().set(model=model, max_steps=steps, output_dir="runs/default")
    cfg.input.set(seq_len=seq_len, batch_size=batch_size)
    cfg.learner.set(learning_rate=lr, warmup_steps=warmup, schedule="cosine")
    return cfg


def _gpt_tiny() -> Trainer.Config:
    model = causal_lm_config(
        vocab=256,
        dim=128,
        layers=2,
        heads=4,
        hidden=512,
        gated=False,
        activation="gelu",
        norm=LayerNorm.default_config(),
    )
    return trainer_config(model, seq_len=128, batch_size=8, lr=3e-3, steps=100, warmup=10)


gpt_tiny = Preset(
    "gpt-tiny", "2-layer GPT on bytes, core layers only (trains in seconds)", _gpt_tiny
)


def resolve_preset(name: str) -> Preset:
    """The registered preset `name`, or your recipe: `module:function` (importable) or
    `path/to/file.py:function`, a function of no arguments returning a Preset or a Trainer
    config; else an error listing the installed presets."""
    from axplug import registry

    try:
        preset = registry.load("presets", name)
    except registry.ComponentNotFoundError:
        if (match := _FILE_RECIPE.fullmatch(name)) is not None:
            preset = _recipe(name, _file_object(name, match["path"], match["function"]))
        elif _MODULE_RECIPE.fullmatch(name):
            preset = _recipe(name, _module_object(name))
        else:
            raise
    if not isinstance(preset, Preset):
        raise ConfigError(f"preset {name!r} is a {type(preset).__qualname__}, not a Preset")
    return preset


_MODULE_RECIPE = re.compile(r"[A-Za-z_][\w.]*:[A-Za-z_][\w.]*")
# `recipes/small.py:build`, `./r.py:build`: a Python file, then the function in it.
_FILE_RECIPE = re.compile(r"(?P<path>.+\.py):(?P<function>[A-Za-z_][\w.]*)")
_RECIPE = "a recipe is a function of no arguments returning an axplug.presets.Preset or a "
_RECIPE += "Trainer config"


def _module_object(name: str) -> Any:
    """What `module:attr` names; an error saying how to make the module importable."""
    import importlib

    module, _, attr = name.partition(":")
    try:
        obj = importlib.import_module(module)
    except ModuleNotFoundError as e:
        if e.name is not None and (module == e.name or module.startswith(e.name + ".")):
            raise ConfigError(
                f"--preset {name!r}: no module named {e.name!r}; put the directory holding "
                f"{module.replace('.', '/')}.py on PYTHONPATH (PYTHONPATH=DIR axplug train "
                f"...), or name the file: --preset path/to/{module.rpartition('.')[2]}.py:{attr}"
            ) from None
        raise ConfigError(f"--preset {name!r}: importing {module} failed: {e}") from None
    except ImportError as e:
        raise ConfigError(f"--preset {name!r}: importing {module} failed: {e}") from None
    except SyntaxError as e:
        raise ConfigError(f"--preset {name!r}: {_syntax(e)}") from None
    return _attribute(name, obj, attr, module)


def _file_object(name: str, file: str, attr: str) -> Any:
    """What `path/to/file.py:attr` names, the file loaded as a module of its own."""
    import hashlib
    import importlib.util
    import pathlib
    import sys

    path = pathlib.Path(file).expanduser()
    if not path.is_file():
        raise ConfigError(f"--preset {name!r}: {path} is not a file")
    resolved = path.resolve()
    # A module name per file: two recipe files called `small.py` never share a module.
    digest = hashlib.sha1(str(resolved).encode()).hexdigest()[:8]
    module_name = f"axplug_recipe_{digest}_{resolved.stem}"
    module = sys.modules.get(module_name)
    if module is None:
        spec = importlib.util.spec_from_file_location(module_name, resolved)
        if spec is None or spec.loader is None:
            raise ConfigError(f"--preset {name!r}: {path} cannot be loaded as Python")
        module = importlib.util.module_from_spec(spec)
        sys.modules[module_name] = module  # dataclasses and pickle look modules up by name
        try:
            spec.loader.exec_module(module)
        except SyntaxError as e:
            del sys.modules[module_name]
            raise ConfigError(f"--preset {name!r}: {_syntax(e)}") from None
        except BaseException:
            del sys.modules[module_name]
            raise
    return _attribute(name, module, attr, str(path))


def _attribute(name: str, obj: Any, attr: str, where: str) -> Any:
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ConfigError(f"--preset {name!r}: {where} has no {attr!r}; {_RECIPE}")
        obj = getattr(obj, part)
    return obj


def _syntax(e: SyntaxError) -> str:
    return f"{e.filename}, line {e.lineno}: {e.msg}"


def _recipe(name: str, made: Any) -> Preset:
    """A Preset from what `name` names: a Preset, or a function returning one or a config."""
    import inspect

    if not isinstance(made, Preset):
        if not callable(made):
            raise ConfigError(f"--preset {name!r} is a {type(made).__qualname__}; {_RECIPE}")
        try:
            inspect.signature(made).bind()
        except TypeError:
            raise ConfigError(
                f"--preset {name!r} takes arguments {inspect.signature(made)}; {_RECIPE}"
            ) from None
        except ValueError:  # no signature to read (some builtins): calling it tells
            try:
                made = made()
            except TypeError as e:
                raise ConfigError(f"--preset {name!r}: {e}; {_RECIPE}") from None
        else:
            made = made()
    if isinstance(made, Preset):
        return made
    if isinstance(made, Trainer.Config):
        return Preset(name, f"the recipe {name}", lambda: made.clone())
    raise ConfigError(f"--preset {name!r} returned a {type(made).__qualname__}; {_RECIPE}")


def _check_modifiers(preset: Preset, specs: Sequence[str]) -> None:
    from axplug import registry
    from axplug.modifiers import parse_modifier_spec

    for spec in specs:
        name, _ = parse_modifier_spec(spec)
        if name not in preset.providers and (head := name.rpartition(":")[0]) in preset.providers:
            name = head  # `name:value` of a modifier not loadable here reads as `dist:name`
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
