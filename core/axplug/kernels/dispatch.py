"""Kernel dispatch: the first supported registered kernel for this backend, else the reference."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from axplug import registry
from axplug.api import AttentionMask, Kernel, why_unsupported
from axplug.kernels.blockwise import BlockwiseKernel
from axplug.kernels.reference import ReferenceKernel

__all__ = [
    "FALLBACK",
    "KernelChoice",
    "registered_kernels",
    "kernel_choices",
    "select_kernel",
    "describe_kernels",
]

FALLBACK = "reference"


class KernelChoice(NamedTuple):
    """One registered kernel and whether it can run a given call."""

    name: str  # registry name (`dist:name` when two distributions share it)
    priority: int
    supported: bool
    reason: str | None  # why not, when unsupported


def registered_kernels(
    names: list[str] | None = None, *, paged: bool = False, grouped: bool = False
) -> list[tuple[str, Kernel]]:
    """(name, kernel) of every loadable `axplug.kernels` entry by priority, or of `names` in
    that order: the dense attention kernels, with `paged` the paged-attention ones
    (`paged = True`, see `axplug.kernels.paged`), with `grouped` the grouped matmuls
    (`grouped_matmul = True`, see `axplug.kernels.grouped`). A kernel whose import fails is
    skipped (the registry records it and `axplug list` shows it as broken)."""
    kernels = []
    for name in registry.names("kernels") if names is None else names:
        try:
            kernel = registry.load_as("kernels", name, Kernel)
        except registry.PluginLoadError:
            continue
        if (kernel.paged, kernel.grouped_matmul) == (paged, grouped):
            kernels.append((name, kernel))
    if names is None:
        kernels.sort(key=lambda nk: (-nk[1].priority, nk[0]))
    return kernels


def _choices(kernels, query, key, value, mask, backend: str, lse=False) -> list[KernelChoice]:
    out = []
    for name, kernel in kernels:
        if lse and not kernel.supports_lse:
            out.append(KernelChoice(name, kernel.priority, False, "no forward_lse"))
            continue
        if mask.linear_bias_slopes is not None and not kernel.supports_linear_bias:
            # A kernel written before the bias existed would ignore it: never chosen for one.
            reason = "a score bias (the kernel does not declare supports_linear_bias)"
            out.append(KernelChoice(name, kernel.priority, False, reason))
            continue
        if mask.logit_softcap is not None and not kernel.supports_logit_softcap:
            # Likewise for a cap: a kernel that does not declare it would leave scores uncapped.
            reason = "logit soft-capping (the kernel does not declare supports_logit_softcap)"
            out.append(KernelChoice(name, kernel.priority, False, reason))
            continue
        if mask.q_causal_limits is not None and not kernel.supports_causal_limits:
            reason = "causal limits (the kernel does not declare supports_causal_limits)"
            out.append(KernelChoice(name, kernel.priority, False, reason))
            continue
        try:
            answer = kernel.is_supported(query, key, value, mask, backend)
        except Exception as exc:  # noqa: BLE001 - a buggy check must not break dispatch
            answer, reason = False, f"is_supported raised {type(exc).__name__}: {exc}"
        else:
            reason = None if answer else why_unsupported(answer)
        out.append(KernelChoice(name, kernel.priority, bool(answer), reason))
    return out


def kernel_choices(query, key, value, mask, *, backend: str | None = None, names=None):
    """A KernelChoice for every kernel in dispatch order, for this call on `backend`."""
    kernels = registered_kernels(names)
    return _choices(kernels, query, key, value, mask, backend or jax.default_backend())


def select_kernel(
    query, key, value, mask, *, backend: str | None = None, names=None, lse: bool = False
):
    """(name, kernel): the first supported kernel in priority order, else the reference;
    with `lse`, the first with `forward_lse` and `backward_lse`, else the blockwise kernel."""
    kernels = registered_kernels(names)
    choices = _choices(kernels, query, key, value, mask, backend or jax.default_backend(), lse)
    for choice, (name, kernel) in zip(choices, kernels, strict=True):
        if choice.supported:
            return name, kernel
    return ("blockwise", BlockwiseKernel()) if lse else (FALLBACK, ReferenceKernel())


def example_call(
    dtype: str = "bfloat16",
    *,
    seq: int = 2048,
    heads: int = 8,
    kv_heads: int = 8,
    head_dim: int = 128,
    sliding_window: int | None = None,
):
    """(query, key, value, mask) of a causal call, as shapes, to ask kernels about."""
    q = jax.ShapeDtypeStruct((1, seq, heads, head_dim), jnp.dtype(dtype))
    kv = jax.ShapeDtypeStruct((1, seq, kv_heads, head_dim), jnp.dtype(dtype))
    positions = jax.ShapeDtypeStruct((1, seq), jnp.int32)
    mask = AttentionMask(
        q_positions=positions, kv_positions=positions, sliding_window=sliding_window
    )
    return q, kv, kv, mask


def describe_kernels(backend: str | None = None, **example: Any) -> list[str]:
    """Lines saying which kernel dispatch picks on `backend` for a typical causal call."""
    backend = backend or jax.default_backend()
    args = example_call(**example)
    q = args[0]
    shape = "x".join(map(str, q.shape))
    lines = [f"attention kernels on backend {backend!r} for a causal {q.dtype} [{shape}] call:"]
    choices = kernel_choices(*args, backend=backend)
    chosen = next((c.name for c in choices if c.supported), FALLBACK)
    for c in choices:
        mark = "chosen" if c.name == chosen else "ok" if c.supported else f"no: {c.reason}"
        lines.append(f"  {c.name:<24} priority {c.priority:<4} {mark}")
    if not any(c.name == chosen for c in choices):
        lines.append(f"  {FALLBACK:<24} (built-in fallback) chosen")
    return lines
