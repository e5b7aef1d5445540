"""The plug point for your own data: a `module:function` that makes an iterator of batches.

The function is called as `make_iterator(start_step, **kwargs)` and returns an iterator of
batch dicts (numpy arrays, e.g. `input_ids` and `target_labels`), starting at `start_step` so
that a resumed run continues where it stopped. A `grain` DataLoader fits directly. Example::

    # my_data.py (importable, e.g. on PYTHONPATH)
    import itertools
    def batches(start_step, *, path):
        loader = make_my_loader(path)  # any iterator of dicts, e.g. a grain.DataLoader
        return itertools.islice(loader, start_step, None)  # or restore the loader's state

    cfg = IteratorInput.default_config().set(make_iterator="my_data:batches", kwargs={"path": "x"})

The function is imported by name with importlib; nothing is evaluated.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from axplug.config import REQUIRED, Required, config_class
from axplug.input.base import Batch, Input, field_error

__all__ = ["IteratorInput", "resolve_function"]


def resolve_function(spec: str) -> Callable[..., Any]:
    """Imports `module.path:function` (the function part may be dotted, e.g. `Cls.method`)."""
    module_name, sep, qualname = spec.partition(":")
    if not sep or not module_name or not qualname:
        raise ValueError(f"expected 'module:function', got {spec!r}")
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"cannot import module {module_name!r} ({type(e).__name__}: {e})") from e
    for part in qualname.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise ValueError(f"module {module_name!r} has no attribute {qualname!r}") from None
    if not callable(obj):
        raise ValueError(f"{spec!r} is a {type(obj).__name__}, not a callable")
    return obj


class IteratorInput(Input):
    """Batches from a user function `make_iterator(start_step, **kwargs) -> Iterator[dict]`."""

    @config_class
    class Config(Input.Config):
        make_iterator: Required[str] = REQUIRED  # "module:function"
        kwargs: dict[str, Any] = {}

        # Names code: an untrusted config (a checkpoint's metadata) may only name the core's
        # or an installed plugin's (axplug.config.serialize).
        CODE_FIELDS = ("make_iterator",)

    def __init__(self, cfg: Config):
        super().__init__(cfg)
        try:
            self._make_iterator = resolve_function(cfg.make_iterator)
        except ValueError as e:
            raise field_error(cfg, "make_iterator", str(e)) from e.__cause__

    def iter_from(self, step: int) -> Iterator[tuple[int, Batch]]:
        cfg = self._config
        iterator = iter(self._make_iterator(step, **cfg.kwargs))
        for batch in iterator:
            if not isinstance(batch, Mapping):
                raise TypeError(
                    f"{cfg.make_iterator} yielded a {type(batch).__name__} at step {step}; "
                    "it must yield dicts of arrays such as {'input_ids': ..., 'target_labels': ...}"
                )
            yield step, dict(batch)
            step += 1
