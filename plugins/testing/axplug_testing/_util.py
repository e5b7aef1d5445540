"""Small helpers the conformance classes share: trace counting and finiteness checks."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

__all__ = ["TraceCounter", "assert_finite", "sum_of_squares", "require"]


class TraceCounter:
    """Wraps `fn`; `count` is how many times jax traced it (Python ran its body)."""

    def __init__(self, fn):
        self.count = 0
        self._fn = fn

    def __call__(self, *args, **kwargs):
        self.count += 1
        return self._fn(*args, **kwargs)


def _float_leaves(tree: Any) -> list:
    return [
        x
        for x in jax.tree.leaves(tree)
        if hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.inexact)
    ]


def assert_finite(tree: Any, what: str) -> None:
    """Fails naming the first leaf path that holds a NaN or inf."""
    for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
        inexact = hasattr(leaf, "dtype") and jnp.issubdtype(leaf.dtype, jnp.inexact)
        if inexact and not np.all(np.isfinite(np.asarray(leaf))):
            raise AssertionError(f"{what}{jax.tree_util.keystr(path)} is not finite")


def sum_of_squares(tree: Any) -> jax.Array:
    """A scalar that depends on every float output (a loss for gradient checks)."""
    leaves = _float_leaves(tree)
    if not leaves:
        raise AssertionError("the forward pass returned no floating-point outputs")
    return jnp.sum(jnp.stack([jnp.mean(jnp.square(x.astype(jnp.float32))) for x in leaves]))


def require(owner: Any, capability: str, known: tuple[str, ...]) -> None:
    """Skips the calling test unless `owner.capabilities` declares `capability`."""
    declared = set(owner.capabilities)
    unknown = declared - set(known)
    if unknown:
        raise AssertionError(
            f"{type(owner).__name__}.capabilities: unknown {sorted(unknown)}; known: {list(known)}"
        )
    if capability not in declared:
        pytest.skip(f"{type(owner).__name__} does not declare capability {capability!r}")


def random_params(model: Any, seed: int = 0) -> Any:
    """Random parameters of `model` made with numpy, on the default device: norm scales (1-D)
    1, every other weight normal over the square root of its input width. For a test whose
    claim holds for any weights: an initializer run op by op compiles each op for each shape."""
    rng = np.random.default_rng(seed)

    def draw(spec: Any) -> np.ndarray:
        if len(spec.shape) == 1:
            return np.ones(spec.shape, np.float32)
        return (rng.standard_normal(spec.shape) / np.sqrt(spec.shape[0])).astype(np.float32)

    specs = model.create_parameter_specs_recursively()
    return jax.device_put(jax.tree.map(draw, specs, is_leaf=lambda x: hasattr(x, "shape")))
