"""BaseLayer: a module with parameters, param/compute dtypes and name-keyed initialization."""

from __future__ import annotations

from typing import Any, ClassVar

import jax
import jax.numpy as jnp

from axplug.api import Initializer, ParameterSpec
from axplug.config import InstantiableConfig, config_class
from axplug.context import name_hash
from axplug.module import Module

__all__ = ["ParameterSpec", "BaseLayer", "Initializer"]


def _is_spec(x: Any) -> bool:
    return isinstance(x, ParameterSpec)


class BaseLayer(Module):
    """A module that owns parameters; dtypes left None are inherited from the parent.

    It declares every optional hook a layer may override, with its default, so callers never
    probe for one: Hugging Face interop (`hf_*`, docs/model-families.md), scanning, folding
    adapters, and a loss fused into the stack.
    """

    # Classes with one role compute the same thing (an unrolled and a scanned stack).
    hf_role: ClassVar[str | None] = None
    # Config fields that do not change what the layer computes (the export check skips them).
    hf_neutral: ClassVar[tuple[str, ...]] = ()
    # True when `hf_write` writes the fields of every layer under it (theirs are not called).
    hf_writes_subtree: ClassVar[bool] = False
    # True when `hf_read` reads the fields of every layer under it (a vision-language model
    # reads its towers from nested objects of config.json); theirs are not called.
    hf_reads_subtree: ClassVar[bool] = False

    @config_class
    class Config(Module.Config):
        # Storage dtype of parameters; None inherits the parent's (root: float32).
        dtype: str | None = None
        # Dtype that parameters are cast to for compute (e.g. "bfloat16"); None inherits the
        # parent's compute dtype (root: its own `dtype`).
        compute_dtype: str | None = None

    def __init__(self, cfg: Config, *, parent: Module | None = None):
        super().__init__(cfg, parent=parent)
        parent_cfg = getattr(parent, "_config", None)
        self._dtype = jnp.dtype(cfg.dtype or getattr(parent_cfg, "dtype", None) or "float32")
        self._compute_dtype = jnp.dtype(
            cfg.compute_dtype or getattr(parent, "compute_dtype", None) or self._dtype
        )

    @property
    def dtype(self) -> jnp.dtype:
        return self._dtype

    @property
    def compute_dtype(self) -> jnp.dtype:
        return self._compute_dtype

    def _add_child(self, name: str, cfg: InstantiableConfig, **kwargs: Any) -> Module:
        if hasattr(cfg, "dtype") and cfg.dtype is None:
            cfg = cfg.clone(dtype=self._dtype.name)
        if hasattr(cfg, "compute_dtype") and cfg.compute_dtype is None:
            cfg = cfg.clone(compute_dtype=self._compute_dtype.name)
        return super()._add_child(name, cfg, **kwargs)

    def _create_layer_parameter_specs(self) -> dict[str, ParameterSpec]:
        """This layer's own parameters (not its children's)."""
        return {}

    def create_parameter_specs_recursively(self) -> dict[str, Any]:
        """Nested dict of ParameterSpecs mirroring the module tree; empty subtrees dropped."""
        specs: dict[str, Any] = dict(self._create_layer_parameter_specs())
        for name, child in self._children.items():
            if isinstance(child, BaseLayer):
                child_specs = child.create_parameter_specs_recursively()
                if child_specs:
                    specs[name] = child_specs
        return specs

    def initialize_parameters_recursively(self, prng_key: jax.Array) -> dict[str, Any]:
        """Parameters for the whole subtree; each key is folded from the parameter's name."""
        return self.initialize_parameters(self.parameter_keys(prng_key))

    def parameter_keys(self, prng_key: jax.Array) -> dict[str, Any]:
        """The PRNG key of each parameter of the subtree: `prng_key` folded with the names on
        the way down (keys of a child without parameters dropped)."""
        keys: dict[str, Any] = {
            name: jax.random.fold_in(prng_key, name_hash(name))
            for name in self._create_layer_parameter_specs()
        }
        for name, child in self._children.items():
            if isinstance(child, BaseLayer):
                child_keys = child.parameter_keys(jax.random.fold_in(prng_key, name_hash(name)))
                if child_keys:
                    keys[name] = child_keys
        return keys

    def initialize_parameters(self, keys: dict[str, Any]) -> dict[str, Any]:
        """Parameters for the whole subtree from its `parameter_keys`."""
        params: dict[str, Any] = {
            name: spec.initializer(keys[name], spec.shape, spec.dtype)
            for name, spec in self._create_layer_parameter_specs().items()
        }
        for name, child in self._children.items():
            if name in keys and isinstance(child, BaseLayer):
                params[name] = child.initialize_parameters(keys[name])
        return params

    @classmethod
    def hf_read(cls, cfg: Any, fields: Any) -> None:
        """Sets `cfg` from config.json `fields` (an `HFFields`); a layer without fields: none."""

    @classmethod
    def hf_write(cls, cfg: Any) -> dict[str, Any]:
        """The config.json fields `cfg` implies; `ValueError` for what they cannot express."""
        return {}

    @classmethod
    def hf_depth(cls, cfg: Any) -> int:
        """How many of config.json's `num_hidden_layers` one of these is in a stack."""
        return 1

    @classmethod
    def hf_layer_path(cls, cfg: Any, i: int) -> str:
        """Where a stack's layer `i` sits below it in the parameter tree."""
        return f"layer{i}"

    @classmethod
    def scanned_config(cls, cfg: Any, *, remat_policy: str) -> Any:
        """The config of this layer's scanned form (`scan_layers`), or None: it has none."""
        return None

    @classmethod
    def applies_to(cls, cfg: Any, module_name: str) -> bool:
        """Whether this layer, given as an adapter, adapts the layer named `module_name`."""
        return True

    @classmethod
    def folded_config(cls, cfg: Any) -> Any:
        """The config once what folds into a plainer layer (an adapter) is folded: itself."""
        return cfg

    @classmethod
    def fold_parameters(cls, cfg: Any, params: dict) -> dict:
        """The parameters of `folded_config` from this layer's: unchanged."""
        return params

    @classmethod
    def info_lines(cls) -> list[str]:
        """Extra lines `axplug info` prints for this layer on this machine."""
        return []

    @property
    def fuses_loss(self) -> bool:
        """Whether the layer computes the loss itself when training (a 1F1B pipeline)."""
        return False

    def active_parameter_fraction(self) -> float:
        """The share of this layer's own weights one token runs through (MFU's FLOPs count):
        all of them, unless the layer routes (e.g. MoE experts: top_k / num_experts)."""
        return 1.0

    def cast(self, x: jax.Array) -> jax.Array:
        """`x` in this layer's compute dtype: what a layer's output should be (a norm that
        computes in float32 returns `self.cast(y)`)."""
        return x.astype(self._compute_dtype)
