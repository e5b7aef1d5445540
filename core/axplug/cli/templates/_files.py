"""The files of each kind of new plugin (its module and its test): here the model components
(layer, kernel, modifier); the rest in `_run_files`. Their `$placeholders` are filled in by
`axplug new-plugin`."""

from __future__ import annotations

from axplug.cli.templates._run_files import (
    COMMAND,
    COMMAND_TEST,
    HOOKS,
    HOOKS_TEST,
    MESH_RULE,
    MESH_RULE_TEST,
    STORAGE,
    STORAGE_TEST,
)

__all__ = ["KIND_FILES", "LAYER_MODIFIER", "LAYER_MODIFIER_TEST"]

LAYER = '''\
"""A feed-forward layer with a squared-ReLU activation: wo(relu(wi(x)) ** 2)."""

from __future__ import annotations

import jax
from axplug.config import REQUIRED, Required, config_class
from axplug.layers import BaseLayer, Linear
from axplug.module import Module

__all__ = ["$cls"]


class $cls(BaseLayer):
    """Drop-in for the core FeedForward: same `input_dim` and `hidden_dim` fields."""

    @config_class
    class Config(BaseLayer.Config):
        input_dim: Required[int] = REQUIRED
        hidden_dim: Required[int] = REQUIRED
        linear: Linear.Config = Linear.default_config()

    def __init__(self, cfg: Config, *, parent: Module | None = None):
        super().__init__(cfg, parent=parent)
        self._add_child("wi", cfg.linear.clone(input_dim=cfg.input_dim, output_dim=cfg.hidden_dim))
        self._add_child(
            "wo",
            cfg.linear.clone(
                input_dim=cfg.hidden_dim, output_dim=cfg.input_dim, mesh_axes=("mlp", "embed")
            ),
        )

    def forward(self, x: jax.Array) -> jax.Array:
        # x: [batch, seq, input_dim] -> [batch, seq, input_dim]
        return self.wo(jax.nn.relu(self.wi(x)) ** 2)
'''

LAYER_TEST = '''\
"""The axplug conformance kit run on this layer."""

import pytest
from axplug.testing import LayerConformance

from $module import $cls


class Test$cls(LayerConformance):
    # Declared, not skipped: drop one to opt out of its checks.
    capabilities = ("differentiable", "shardable", "swappable_in_llama")

    @pytest.fixture
    def layer_config(self):
        return $cls.default_config().set(input_dim=16, hidden_dim=32)
'''

KERNEL = '''\
"""An attention kernel in plain jax.numpy, under the `axplug.kernels` protocol."""

from __future__ import annotations

import jax
import jax.numpy as jnp

__all__ = ["$cls"]

NEG_INF = -1e30


class $cls:
    """softmax(q k^T * scale + mask) v in float32; k/v may have fewer heads (grouped)."""

    priority = 5  # higher is tried first (reference 0, xla 10, hardware kernels 100+)

    def is_supported(self, query, key, value, mask, backend: str):
        # Decide from shapes, dtypes and the mask's static fields only: called at trace time.
        return query.ndim == 4 and key.shape == value.shape and query.shape[2] % key.shape[2] == 0

    def __call__(self, query, key, value, mask, *, scale: float) -> jax.Array:
        # query: [b, sq, h, d]; key, value: [b, skv, kvh, d] -> [b, sq, h, d]
        b, sq, h, d = query.shape
        kvh = key.shape[2]
        q = query.reshape(b, sq, kvh, h // kvh, d)
        logits = jnp.einsum("bqngd,bknd->bngqk", q, key, preferred_element_type=jnp.float32)
        allowed = mask.dense()[:, :, None]  # [b, 1, 1, sq, skv]
        logits = jnp.where(allowed, logits * scale, NEG_INF)
        probs = jax.nn.softmax(logits, axis=-1).astype(value.dtype)
        out = jnp.einsum("bngqk,bknd->bqngd", probs, value)
        return out.reshape(b, sq, h, d)
'''

KERNEL_TEST = '''\
"""The axplug conformance kit run on this kernel, against the reference attention."""

import pytest
from axplug.testing import KernelConformance

from $module import $cls


class Test$cls(KernelConformance):
    capabilities = ("gqa", "non_causal", "sliding_window", "segment_ids", "differentiable")

    @pytest.fixture
    def kernel(self):
        return $cls()
'''

MODIFIER = '''\
"""A config modifier that sets the activation of every FeedForward.

Use: `axplug train ... --modifier $name:activation=gelu`.
"""

from __future__ import annotations

import copy

from axplug.config import ConfigBase, ConfigError, ConfigModifier, config_class, find_configs
from axplug.layers import FeedForward

__all__ = ["$cls"]


class $cls(ConfigModifier):
    """Sets `activation` on every FeedForward of the config tree; the input is not mutated."""

    @config_class
    class Config(ConfigModifier.Config):
        activation: str = "gelu"

    def __call__(self, cfg: ConfigBase) -> ConfigBase:
        cfg = copy.deepcopy(cfg)
        found = find_configs(cfg, FeedForward)
        if not found:
            raise ConfigError("modifier $name: the config has no FeedForward to modify")
        for _, sub in found:
            sub.activation = self.config.activation
        return cfg
'''

MODIFIER_TEST = '''\
"""The modifier applies cleanly to a stock preset, does not mutate it, and trains."""

import jax
from axplug.config import find_configs
from axplug.layers import FeedForward
from axplug.presets import preset_config

from $module import $cls


def tiny(tmp_path):
    return preset_config(
        "gpt-tiny",
        overrides=[
            f"output_dir={str(tmp_path)!r}",
            "max_steps=2",
            "checkpoint_every=2",
            "compilation_cache_dir=None",
            "summary_writers=[]",
            "model.decoder.dim=32",
            "model.decoder.transformer.layer.feed_forward.hidden_dim=64",
            "input.seq_len=32",
            "input.batch_size=4",
            "mesh.mesh_shape=(1, 1, 1, 1, 1)",
        ],
    )


def test_modifier_applies_without_mutating(tmp_path):
    cfg = tiny(tmp_path)
    before = cfg.debug_string()
    modifier = $cls.default_config().set(activation="relu").instantiate()
    out = modifier(cfg)
    assert cfg.debug_string() == before
    assert {sub.activation for _, sub in find_configs(out, FeedForward)} == {"relu"}
    assert modifier(out).debug_string() == out.debug_string()  # applying twice is harmless


def test_modified_preset_trains(tmp_path):
    cfg = $cls.default_config().instantiate()(tiny(tmp_path))
    metrics = cfg.instantiate(devices=jax.devices()[:1]).run()
    assert metrics["step"] == 2
'''

LAYER_MODIFIER = '''\
"""`--modifier $name`: $cls in place of every core FeedForward of a config tree."""

from __future__ import annotations

from axplug.config import ConfigBase, ConfigError, ConfigModifier, find_configs, replace_config
from axplug.layers import FeedForward

from $module.layer import $cls

__all__ = ["${cls}Modifier"]


class ${cls}Modifier(ConfigModifier):
    """Every FeedForward becomes a $cls, its dims carried over; the input is not mutated."""

    def __call__(self, cfg: ConfigBase) -> ConfigBase:
        if not find_configs(cfg, FeedForward) and not find_configs(cfg, $cls):
            raise ConfigError("modifier '$name': the config has no FeedForward to replace")
        # Options would be fields of a Config here, read as self.config.<field> and passed as
        # replace_config(..., owned=[...]) so that applying the modifier again resets them.
        new = $cls.default_config()
        return replace_config(cfg, target=FeedForward, new_cfg=new, missing_ok=True)
'''

LAYER_MODIFIER_TEST = '''\
"""`--modifier $name` puts the layer into a stock preset, which then trains."""

import jax
from axplug.config import find_configs
from axplug.layers import FeedForward
from axplug.modifiers import make_modifier
from axplug.presets import preset_config

from $module import $cls


def test_modifier_swaps_every_feed_forward_and_trains(tmp_path):
    cfg = preset_config(
        "gpt-tiny",
        overrides=[
            f"output_dir={str(tmp_path)!r}",
            "max_steps=2",
            "checkpoint_every=2",
            "compilation_cache_dir=None",
            "summary_writers=[]",
            "model.decoder.dim=32",
            "model.decoder.transformer.layer.feed_forward.hidden_dim=64",
            "input.seq_len=32",
            "input.batch_size=4",
            "mesh.mesh_shape=(1, 1, 1, 1, 1)",
        ],
    )
    out = make_modifier("$name")(cfg)  # through the registry, as `--modifier $name` does
    assert find_configs(out, $cls) and not find_configs(out, FeedForward)
    assert make_modifier("$name")(out).debug_string() == out.debug_string()  # idempotent
    assert out.instantiate(devices=jax.devices()[:1]).run()["step"] == 2
'''

KIND_FILES = {
    "layer": ("axplug.layers", "layer", LAYER, LAYER_TEST),
    "kernel": ("axplug.kernels", "kernel", KERNEL, KERNEL_TEST),
    "mesh-rule": ("axplug.mesh_rules", "mesh_rule", MESH_RULE, MESH_RULE_TEST),
    "modifier": ("axplug.modifiers", "modifier", MODIFIER, MODIFIER_TEST),
    "hooks": ("axplug.hooks", "hooks", HOOKS, HOOKS_TEST),
    "storage": ("axplug.storage", "storage", STORAGE, STORAGE_TEST),
    "command": ("axplug.commands", "command", COMMAND, COMMAND_TEST),
}
