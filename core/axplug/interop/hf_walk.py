"""The model config walked for Hugging Face fields: each layer reads and writes its own.

A layer class with Hugging Face fields overrides `hf_read(cfg, fields)` and `hf_write(cfg) ->
dict`, declared on `BaseLayer` with empty defaults. `read_fields` calls every `hf_read` of a
model config, parents first, except under a layer whose class sets `hf_reads_subtree = True`
(a vision-language model reads each tower from its own nested object); `write_fields` merges
every `hf_write`, except under a layer whose class sets `hf_writes_subtree = True`, whose
own `hf_write` writes the fields of every layer config under it (a stack whose layers differ
by kind writes them per kind).
`differences` says what of a run's model an architecture does not build, so an export never
writes a config.json that computes something else.
"""

from __future__ import annotations

from typing import Any

from axplug.config import ConfigBase, InstantiableConfig, configurable_class, to_dict, visit
from axplug.layers.base import BaseLayer

__all__ = ["hf_layers", "read_fields", "write_fields", "differences"]

# Config fields that change how a model runs or trains, never what it computes once trained:
# kernels and caches, sharding, initialization, dtypes, dropout, rematerialization.
NEUTRAL_FIELDS = frozenset(
    {
        "name", "kernel", "kv_cache", "mesh_axes", "init_scale", "dtype", "param_dtype",
        "compute_dtype", "dropout_rate", "remat_policy", "dispatch",
    }
)  # fmt: skip


def hf_layers(model: ConfigBase) -> list[tuple[str, InstantiableConfig]]:
    """(path, config) of every layer config under `model`, parents before children."""
    found: list[tuple[str, InstantiableConfig]] = []

    def collect(path: str, value: Any) -> None:
        if _layer_class(value) is not None:
            found.append((path, value))

    collect("", model)
    visit(model, collect)
    return found


def _layer_class(value: Any) -> type[BaseLayer] | None:
    """The layer class `value` configures, if it configures a layer."""
    klass = configurable_class(value)
    return klass if klass is not None and issubclass(klass, BaseLayer) else None


def read_fields(model: ConfigBase, fields: Any) -> None:
    """Sets every layer config under `model` from config.json `fields`, parents first."""
    done: set[int] = set()
    covered: list[str] = []  # paths of layers whose hf_read reads the layers under them
    for path, cfg in hf_layers(model):
        if id(cfg) in done or any(_under(path, top) for top in covered):
            continue  # a config shared by two slots is read once
        done.add(id(cfg))
        if cfg.klass.hf_reads_subtree:
            covered.append(path)
        cfg.klass.hf_read(cfg, fields)


def write_fields(model: ConfigBase) -> tuple[dict, list[str]]:
    """(the config.json fields of `model`, what its layers cannot express, by path)."""
    out: dict[str, Any] = {}
    problems: list[str] = []
    owner: dict[str, str] = {}
    covered: list[str] = []  # paths of layers whose hf_write covers the layers under them
    for path, cfg in hf_layers(model):
        if any(_under(path, top) for top in covered):
            continue
        if cfg.klass.hf_writes_subtree:
            covered.append(path)
        where = f"model.{path}" if path else "model"
        try:
            written = cfg.klass.hf_write(cfg)
        except ValueError as exc:
            problems.append(f"{where}: {exc}")
            continue
        for key, value in written.items():
            if key in out and out[key] != value:
                problems.append(
                    f"{where} writes {key}={value!r}, but {owner[key]} wrote {out[key]!r}"
                )
                continue
            out[key], owner[key] = value, where
    return out, problems


def _under(path: str, top: str) -> bool:
    """Whether the config at `path` lies strictly under the one at `top`."""
    if not top:
        return bool(path)
    return path.startswith((f"{top}.", f"{top}["))


def _neutral(cfg: Any) -> frozenset[str]:
    layer = _layer_class(cfg)
    return NEUTRAL_FIELDS | frozenset(layer.hf_neutral if layer is not None else ())


def differences(run: Any, built: Any, path: str = "model") -> list[str]:
    """Where the run's model config differs from the one an architecture built, ignoring what
    does not change the numerics (`NEUTRAL_FIELDS`, a layer's own `hf_neutral`)."""
    if isinstance(run, ConfigBase) and isinstance(built, ConfigBase):
        out = []
        neutral = _neutral(run) | _neutral(built)
        for key in sorted(set(run.keys()) | set(built.keys())):
            if key == "kernel":
                # Any kernel computes the same attention, but not at another scale.
                a, b = (getattr(getattr(c, key, None), "scale", None) for c in (run, built))
                if a != b:
                    out.append(f"{path}.kernel.scale: {a!r} (the architecture has {b!r})")
                continue
            if key in neutral:
                continue
            a, b = getattr(run, key, None), getattr(built, key, None)
            if key == "klass" and _same_role(a, b):
                continue
            out += differences(a, b, f"{path}.{key}")
        return out
    if (
        isinstance(run, (list, tuple))
        and isinstance(built, (list, tuple))
        and len(run) == len(built)
    ):
        pairs = enumerate(zip(run, built, strict=True))
        return [d for i, (a, b) in pairs for d in differences(a, b, f"{path}[{i}]")]
    if _plain(run) != _plain(built):
        return [f"{path}: {_show(run)} (the architecture has {_show(built)})"]
    return []


def _same_role(a: Any, b: Any) -> bool:
    """Classes that compute the same thing (an unrolled and a scanned stack)."""

    def role(k: Any) -> Any:
        return k.hf_role or k if isinstance(k, type) and issubclass(k, BaseLayer) else k

    return a is b or role(a) == role(b)


def _plain(value: Any) -> Any:
    if isinstance(value, ConfigBase):
        return to_dict(value)
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


def _show(value: Any) -> str:
    if isinstance(value, type):
        return value.__name__
    if isinstance(value, ConfigBase):
        return getattr(getattr(value, "klass", None), "__name__", type(value).__qualname__)
    return repr(value)
