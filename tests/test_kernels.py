"""Conformance of every attention kernel registered here against a plain-jnp reference.

One test, parametrized over every `axplug.kernels` entry importable in this environment (plus
the `flash_attention` dispatch layer), compares forward outputs and gradients with respect to
q, k and v on causal, windowed, segmented (packed), GQA/MQA and decode-shaped (cache) masks.
A hardware plugin's kernel joins automatically when its distribution is installed; a kernel
that declines a case through `is_supported` is skipped for that case, with its reason.

Tolerance policy (same as tests/test_layers.py):
- float32: forward rtol = atol = 1e-5; gradients 1e-4 (a softmax backward reorders sums).
- bfloat16 inputs: rtol = atol = 2e-2 against the float32 reference of the same inputs
  (8-bit mantissa, a few roundings compound to ~1e-2).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from axplug import registry

axplug_attention = pytest.importorskip("axplug_attention")
if not any(c.distribution == "axplug-attention" and c.loadable for c in registry.discover()):
    pytest.skip("axplug-attention is disabled", allow_module_level=True)

from axplug.context import functional  # noqa: E402
from axplug.layers import AttentionMask  # noqa: E402

F32 = dict(rtol=1e-5, atol=1e-5)
F32_GRAD = dict(rtol=1e-4, atol=1e-4)
BF16 = dict(rtol=2e-2, atol=2e-2)
EMPTY = 2**30  # position of a cache slot not written yet (after every real position)


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    heads: int = 4
    kv_heads: int = 4
    q_positions: tuple = tuple(range(8))
    kv_positions: tuple | None = None  # None: the q positions (self-attention)
    segments: tuple | None = None  # per-position segment ids of q (and kv)
    causal: bool = True
    window: int | None = None
    dtype: str = "float32"
    head_dim: int = 16


CASES = [
    Case("causal"),
    Case("causal_gqa", kv_heads=2),
    Case("causal_mqa", kv_heads=1),
    Case("window", window=3, kv_heads=2),
    Case(
        "segments",  # two packed sequences; positions restart in each
        q_positions=(0, 1, 2, 3, 4, 0, 1, 2),
        segments=(0, 0, 0, 0, 0, 1, 1, 1),
        kv_heads=2,
    ),
    Case(
        "segments_window",
        q_positions=(0, 1, 2, 3, 4, 0, 1, 2),
        segments=(0, 0, 0, 0, 0, 1, 1, 1),
        window=2,
    ),
    Case(
        "bidirectional_segments",
        causal=False,
        q_positions=(0, 1, 2, 0, 1, 2, 3, 4),
        segments=(3, 3, 3, 5, 5, 5, 5, 5),
    ),
    Case(  # one decode step at position 6 against a 10-slot cache holding positions 0..6
        "decode",
        q_positions=(6,),
        kv_positions=(0, 1, 2, 3, 4, 5, 6, EMPTY, EMPTY, EMPTY),
        kv_heads=2,
    ),
    Case(  # a 3-token chunk after a 4-token prefix, windowed
        "chunk_window",
        q_positions=(4, 5, 6),
        kv_positions=(0, 1, 2, 3, 4, 5, 6, EMPTY),
        window=4,
        kv_heads=1,
    ),
    Case("causal_gqa_bf16", kv_heads=2, dtype="bfloat16"),
]


def kernel_names() -> list[str]:
    return registry.names("kernels")


def inputs(case: Case, batch: int = 2):
    rng = np.random.default_rng(len(case.name))
    sq = len(case.q_positions)
    kv_pos = case.kv_positions or case.q_positions
    skv = len(kv_pos)
    q = rng.standard_normal((batch, sq, case.heads, case.head_dim))
    k = rng.standard_normal((batch, skv, case.kv_heads, case.head_dim))
    v = rng.standard_normal((batch, skv, case.kv_heads, case.head_dim))
    cot = rng.standard_normal((batch, sq, case.heads, case.head_dim))
    seg = None
    if case.segments is not None:
        seg = jnp.asarray(np.broadcast_to(case.segments, (batch, sq)), jnp.int32)
    mask = AttentionMask(
        q_positions=jnp.asarray(np.broadcast_to(case.q_positions, (batch, sq)), jnp.int32),
        kv_positions=jnp.asarray(np.broadcast_to(kv_pos, (batch, skv)), jnp.int32),
        q_segment_ids=seg,
        kv_segment_ids=seg,
        causal=case.causal,
        sliding_window=case.window,
    )
    dt = jnp.dtype(case.dtype)
    return (jnp.asarray(q, dt), jnp.asarray(k, dt), jnp.asarray(v, dt)), mask, jnp.asarray(cot)


def ref_allowed(case: Case) -> np.ndarray:
    """[q, kv] booleans, written from the definitions (not from AttentionMask.dense)."""
    qp = case.q_positions
    kp = case.kv_positions or qp
    out = np.zeros((len(qp), len(kp)), bool)
    for i, a in enumerate(qp):
        for j, b in enumerate(kp):
            ok = b != EMPTY
            ok &= not case.causal or b <= a
            ok &= case.window is None or abs(a - b) < case.window
            ok &= case.segments is None or case.segments[i] == case.segments[j]
            out[i, j] = ok
    return out


def ref_attention(q, k, v, allowed, scale):
    """Plain softmax attention in float32 with k/v heads repeated to the query heads."""
    q, k, v = (x.astype(jnp.float32) for x in (q, k, v))
    rep = q.shape[2] // k.shape[2]
    k, v = jnp.repeat(k, rep, axis=2), jnp.repeat(v, rep, axis=2)
    logits = jnp.einsum("bqhd,bkhd->bhqk", q, k) * scale
    logits = jnp.where(jnp.asarray(allowed), logits, -jnp.inf)
    e = jnp.exp(logits - logits.max(-1, keepdims=True))
    return jnp.einsum("bhqk,bkhd->bqhd", e / e.sum(-1, keepdims=True), v)


def run_kernel(name: str):
    """(fn(q, k, v, mask), kernel) for kernel `name`; `dispatch`: the dispatch layer, None."""
    if name == "dispatch":
        layer = axplug_attention.FlashAttention.default_config().instantiate(parent=None)

        def fn(q, k, v, mask):
            out, _ = functional(
                layer, prng_key=None, state={}, inputs=(q, k, v, mask), is_training=False
            )
            return out

        return fn, None
    kernel = dict(axplug_attention.registered_kernels([name]))[name]

    def fn(q, k, v, mask):
        return kernel(q, k, v, mask, scale=1.0 / math.sqrt(q.shape[-1]))

    return fn, kernel


def assert_close(actual, desired, tol):
    np.testing.assert_allclose(
        np.asarray(actual, np.float32), np.asarray(desired, np.float32), **tol
    )


def forward_and_grads(fn, q, k, v, cot):
    """(out, (dq, dk, dv)) of fn(q, k, v) for the cotangent `cot`, in one compiled program."""

    def both(q, k, v):
        out, vjp = jax.vjp(fn, q, k, v)
        return out, vjp(cot.astype(out.dtype))

    return jax.jit(both)(q, k, v)


@functools.cache
def reference(case: Case):
    (q, k, v), _, cot = inputs(case)
    allowed = ref_allowed(case)
    scale = 1.0 / math.sqrt(case.head_dim)
    return forward_and_grads(lambda q, k, v: ref_attention(q, k, v, allowed, scale), q, k, v, cot)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
@pytest.mark.parametrize("name", [*kernel_names(), "dispatch"])
def test_kernel_matches_reference(name, case):
    (q, k, v), mask, cot = inputs(case)
    fn, kernel = run_kernel(name)
    if kernel is not None:
        answer = kernel.is_supported(q, k, v, mask, jax.default_backend())
        if not answer:
            pytest.skip(f"{name}: {getattr(answer, 'reason', 'unsupported')}")
    out, grads = forward_and_grads(lambda q, k, v: fn(q, k, v, mask), q, k, v, cot)
    expected, ref_grads = reference(case)
    assert out.shape == q.shape and out.dtype == v.dtype
    bf16 = case.dtype == "bfloat16"
    assert_close(out, expected, BF16 if bf16 else F32)
    for g, r, what in zip(grads, ref_grads, "qkv", strict=True):
        assert g.shape == r.shape and g.dtype == q.dtype, what
        # bf16 gradients: the absolute tolerance scales with the gradient's magnitude.
        magnitude = float(np.abs(np.asarray(r, np.float32)).max())
        assert_close(g, r, dict(BF16, atol=BF16["atol"] * magnitude) if bf16 else F32_GRAD)


def test_every_kernel_declares_a_priority_and_a_support_check():
    for name, kernel in axplug_attention.registered_kernels():
        assert isinstance(getattr(kernel, "priority", None), int), name
        assert callable(getattr(kernel, "is_supported", None)), name
