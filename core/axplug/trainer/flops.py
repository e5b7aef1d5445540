"""The analytic FLOP model of a train step, for MFU in training and in `axplug aot`."""

from __future__ import annotations

import math

import jax

from axplug.api import ParameterSpec
from axplug.input import batch_shape
from axplug.layers import BaseLayer, RepeatedTransformer

__all__ = ["analytic_flops", "active_parameters", "model_flops_per_step"]


def analytic_flops(num_params: float, *, layers: int, dim: int, seq: int, batch: int) -> float:
    """Training FLOPs per step: 6·params·tokens + 12·layers·dim·seq·tokens (PaLM, App. B;
    attention counted without the causal half, as MFU conventions do)."""
    tokens = batch * seq
    return 6.0 * num_params * tokens + 12.0 * layers * dim * seq * tokens


def active_parameters(model) -> float:
    """Parameters one token runs through: all of them, except that a layer counts the share
    of its own weights its `active_parameter_fraction()` gives (MoE experts: top_k / experts).
    Scanned stacks count their layer `num_layers` times."""

    def count(specs) -> int:
        leaves = _leaves(specs, ParameterSpec)
        return sum(math.prod(s.shape) for s in leaves)

    inactive = 0.0

    def visit(module, times: int) -> None:
        nonlocal inactive
        if isinstance(module, BaseLayer) and (fraction := module.active_parameter_fraction()) < 1:
            own = count(module._create_layer_parameter_specs())
            inactive += (1.0 - fraction) * own * times
        if isinstance(module, RepeatedTransformer):
            times *= module.config.num_layers
        for child in module.children.values():
            visit(child, times)

    visit(model, 1)
    return count(model.create_parameter_specs_recursively()) - inactive


def _leaves(tree, leaf_type) -> list:
    return jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, leaf_type))


def model_flops_per_step(cfg, model=None) -> float:
    """Analytic training FLOPs of one step of trainer config `cfg`: 6 x active parameters x
    tokens plus attention (`analytic_flops`)."""
    model = model or cfg.model.instantiate(parent=None, _path="model")
    try:  # a decoder-only LM; other models get the 6·N·D term alone
        layers, dim = cfg.model.decoder.transformer.num_layers, cfg.model.decoder.dim
    except AttributeError:
        layers, dim = 0, 0
    batch, seq = batch_shape(cfg.input) or (0, 0)
    return analytic_flops(active_parameters(model), layers=layers, dim=dim, seq=seq, batch=batch)
