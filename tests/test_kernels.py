"""Attention kernels: every registered kernel against a plain-jnp reference, and dispatch.

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
from axplug_testing import KernelConformance

from axplug import registry
from axplug.api import AttentionMask, Unsupported
from axplug.config import ConfigError
from axplug.context import functional
from axplug.kernels import (
    XlaKernel,
    describe_kernels,
    kernel_choices,
    registered_kernels,
    select_kernel,
)
from axplug.layers import DotProductKernel, FlashAttention

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
    slopes: tuple | None = None  # per query head: ALiBi's linear distance bias
    softcap: float | None = None  # the mask's logit_softcap: cap * tanh(scores / cap)


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
    Case("alibi", slopes=(0.5, 0.25, 0.125, 0.0625)),
    Case(  # ALiBi on packed sequences, grouped heads and a window
        "alibi_gqa_segments_window",
        q_positions=(0, 1, 2, 3, 4, 0, 1, 2),
        segments=(0, 0, 0, 0, 0, 1, 1, 1),
        window=3,
        kv_heads=2,
        slopes=(1.0, 0.5, 0.25, 0.125),
    ),
    Case(  # one ALiBi decode step: the bias follows positions, not cache slots
        "alibi_decode",
        q_positions=(6,),
        kv_positions=(0, 1, 2, 3, 4, 5, 6, EMPTY, EMPTY, EMPTY),
        kv_heads=1,
        slopes=(0.5, 0.25, 0.125, 0.0625),
    ),
    # Caps near the scores' scale (about 1: head_dim 16, unit normal q, k), so tanh bends them.
    Case("softcap", softcap=1.0),
    Case(  # Gemma 2's mix: soft-capped GQA with a sliding window, packed
        "softcap_gqa_window_segments",
        q_positions=(0, 1, 2, 3, 4, 0, 1, 2),
        segments=(0, 0, 0, 0, 0, 1, 1, 1),
        window=3,
        kv_heads=2,
        softcap=0.5,
    ),
    Case(  # one soft-capped decode step against a cache
        "softcap_decode",
        q_positions=(6,),
        kv_positions=(0, 1, 2, 3, 4, 5, 6, EMPTY, EMPTY, EMPTY),
        kv_heads=1,
        softcap=0.5,
    ),
    Case("softcap_alibi", slopes=(0.5, 0.25, 0.125, 0.0625), softcap=1.0),  # cap, then bias
]


def kernel_names() -> list[str]:
    """The dense attention kernels (paged ones are tested in test_paged_attention.py)."""
    from axplug.kernels import registered_kernels

    return [name for name, _ in registered_kernels()]


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
        linear_bias_slopes=None if case.slopes is None else jnp.asarray(case.slopes, jnp.float32),
        logit_softcap=case.softcap,
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


def ref_bias(case: Case) -> np.ndarray:
    """[heads, q, kv] ALiBi bias -slope_h * |q_pos - kv_pos|, from the definition."""
    qp = np.asarray(case.q_positions, np.float64)
    kp = np.asarray(case.kv_positions or case.q_positions, np.float64)
    slopes = np.asarray(case.slopes or (0.0,) * case.heads, np.float64)
    return -slopes[:, None, None] * np.abs(qp[:, None] - kp[None, :])


def ref_attention(q, k, v, allowed, scale, bias=0.0, softcap=None):
    """Plain softmax attention in float32 with k/v heads repeated to the query heads; the
    scaled scores soft-capped (softcap * tanh(s / softcap)) before the bias and the mask."""
    q, k, v = (x.astype(jnp.float32) for x in (q, k, v))
    rep = q.shape[2] // k.shape[2]
    k, v = jnp.repeat(k, rep, axis=2), jnp.repeat(v, rep, axis=2)
    logits = jnp.einsum("bqhd,bkhd->bhqk", q, k) * scale
    if softcap is not None:
        logits = softcap * jnp.tanh(logits / softcap)
    logits = logits + jnp.asarray(bias, jnp.float32)
    logits = jnp.where(jnp.asarray(allowed), logits, -jnp.inf)
    e = jnp.exp(logits - logits.max(-1, keepdims=True))
    return jnp.einsum("bhqk,bkhd->bqhd", e / e.sum(-1, keepdims=True), v)


def run_kernel(name: str):
    """(fn(q, k, v, mask), kernel) for kernel `name`; `dispatch`: the dispatch layer, None."""
    if name == "dispatch":
        layer = FlashAttention.default_config().instantiate(parent=None)

        def fn(q, k, v, mask):
            out, _ = functional(
                layer, prng_key=None, state={}, inputs=(q, k, v, mask), is_training=False
            )
            return out

        return fn, None
    kernel = dict(registered_kernels([name]))[name]

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
    allowed, bias = ref_allowed(case), ref_bias(case)
    scale = 1.0 / math.sqrt(case.head_dim)
    return forward_and_grads(
        lambda q, k, v: ref_attention(q, k, v, allowed, scale, bias, case.softcap), q, k, v, cot
    )


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
@pytest.mark.parametrize("name", [*kernel_names(), "dispatch"])
def test_kernel_matches_reference(name, case):
    (q, k, v), mask, cot = inputs(case)
    fn, kernel = run_kernel(name)
    if kernel is not None:
        if case.slopes is not None and not getattr(kernel, "supports_linear_bias", False):
            pytest.skip(f"{name}: no supports_linear_bias (dispatch never gives it a bias)")
        if case.softcap is not None and not getattr(kernel, "supports_logit_softcap", False):
            pytest.skip(f"{name}: no supports_logit_softcap (dispatch never gives it a cap)")
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
    for name, kernel in registered_kernels():
        assert isinstance(getattr(kernel, "priority", None), int), name
        assert callable(getattr(kernel, "is_supported", None)), name


# ------------------------------------------------------------------------ kernel dispatch

FAKE_KERNELS = """
import jax.numpy as jnp
from axplug.api import AttentionKernel, Unsupported


class NeedsGpu(AttentionKernel):
    priority = 100

    def is_supported(self, query, key, value, mask, backend):
        return True if backend == "gpu" else Unsupported("needs the gpu backend")

    def __call__(self, query, key, value, mask, *, scale):
        return jnp.full(query.shape, 1.0, value.dtype)


class TpuOnly(AttentionKernel):
    priority = 50

    def is_supported(self, query, key, value, mask, backend):
        return backend == "tpu"

    def __call__(self, query, key, value, mask, *, scale):
        return jnp.full(query.shape, 2.0, value.dtype)


class Raises(AttentionKernel):
    priority = 70

    def is_supported(self, query, key, value, mask, backend):
        raise RuntimeError("bad check")
"""


@pytest.fixture
def fake_kernels(plugin_site):
    # The core's reference and xla kernels are discovered with these.
    plugin_site.add(
        "fake-hw",
        {
            "axplug.kernels": {
                "needs_gpu": "fake_hw_kernels:NeedsGpu",
                "tpu_only": "fake_hw_kernels:TpuOnly",
                "raises": "fake_hw_kernels:Raises",
                "broken": "fake_hw_missing:Kernel",
            }
        },
        modules={"fake_hw_kernels": FAKE_KERNELS},
    )
    return plugin_site


def example_call():
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.standard_normal((2, 8, 4, 8)), jnp.float32)
    kv = jnp.asarray(rng.standard_normal((2, 8, 2, 8)), jnp.float32)
    positions = jnp.broadcast_to(jnp.arange(8, dtype=jnp.int32), (2, 8))
    return q, kv, kv, AttentionMask(q_positions=positions, kv_positions=positions)


def run_layer(cfg, args):
    """The layer of `cfg` on `args`, as one compiled program (not one per eager op)."""
    layer = cfg.instantiate(parent=None)

    def call(*args):
        return functional(layer, prng_key=None, state={}, inputs=args, is_training=False)[0]

    return jax.jit(call)(*args)


def test_dispatch_takes_the_first_supported_kernel_by_priority(fake_kernels):
    args = example_call()
    choices = kernel_choices(*args, backend="cpu")
    names = ["needs_gpu", "raises", "tpu_only", "blockwise", "xla", "reference"]
    assert [c.name for c in choices] == names
    reasons = {c.name: c.reason for c in choices}
    assert reasons["needs_gpu"] == "needs the gpu backend"
    assert reasons["raises"] == "is_supported raised RuntimeError: bad check"
    assert reasons["tpu_only"] == "not supported" and reasons["xla"] is None
    assert select_kernel(*args, backend="cpu")[0] == "xla"
    assert select_kernel(*args, backend="tpu")[0] == "tpu_only"
    assert select_kernel(*args, backend="gpu")[0] == "needs_gpu"
    # Only the named kernels, in the given order; none supported: the reference.
    assert select_kernel(*args, backend="gpu", names=["tpu_only", "xla"])[0] == "xla"
    assert select_kernel(*args, backend="cpu", names=["needs_gpu"])[0] == "reference"
    # The broken kernel is skipped, never fatal, and `axplug list` reports it.
    (broken,) = [c for c in registry.discover("kernels") if c.name == "broken"]
    assert broken.status == "broken" and "fake_hw_missing" in broken.reason


def test_a_bias_goes_only_to_kernels_that_declare_it(fake_kernels):
    # A kernel from before plugin API 1.1 would ignore the slopes: dispatch never picks it.
    q, k, v, mask = example_call()
    biased = dataclasses.replace(mask, linear_bias_slopes=jnp.asarray([1.0, 0.5, 0.25, 0.125]))
    assert select_kernel(q, k, v, mask, backend="gpu")[0] == "needs_gpu"
    assert select_kernel(q, k, v, biased, backend="gpu")[0] == "xla"
    reasons = {c.name: c.reason for c in kernel_choices(q, k, v, biased, backend="gpu")}
    assert reasons["needs_gpu"] == "a score bias (the kernel does not declare supports_linear_bias)"
    assert reasons["xla"] is None and reasons["reference"] is None


def test_a_softcap_goes_only_to_kernels_that_declare_it(fake_kernels):
    # As for the bias: a kernel that does not declare the cap would leave scores uncapped.
    q, k, v, mask = example_call()
    capped = dataclasses.replace(mask, logit_softcap=50.0)
    assert select_kernel(q, k, v, mask, backend="gpu")[0] == "needs_gpu"
    assert select_kernel(q, k, v, capped, backend="gpu")[0] == "xla"
    assert select_kernel(q, k, v, capped, backend="tpu")[0] == "xla"  # not tpu_only either
    choices = kernel_choices(q, k, v, capped, backend="gpu")
    reasons = {c.name: c.reason for c in choices}
    no_cap = "logit soft-capping (the kernel does not declare supports_logit_softcap)"
    assert reasons["needs_gpu"] == reasons["tpu_only"] == reasons["raises"] == no_cap
    assert reasons["xla"] is None and reasons["reference"] is None
    # Whatever is installed: dispatch never picks a kernel without the capability ...
    for c in choices:
        kernel = dict(registered_kernels([c.name]))[c.name]
        assert not c.supported or getattr(kernel, "supports_logit_softcap", False), c.name
    # ... and AttentionKernel's own check answers Unsupported for one (a direct caller).
    from axplug.api import AttentionKernel

    answer = AttentionKernel().is_supported(q, k, v, capped, "cpu")
    assert not answer and "logit soft-capping" in answer.reason
    assert AttentionKernel().is_supported(q, k, v, mask, "cpu") is True


def test_every_installed_kernel_without_the_capability_declines_a_cap():
    from axplug_testing import abstract_call

    for name, kernel in registered_kernels():
        if getattr(kernel, "supports_logit_softcap", False):
            continue
        for backend in ("cpu", "gpu", "tpu", "neuron"):
            for q_seq in (None, 1):
                args = abstract_call(logit_softcap=30.0, q_seq=q_seq)
                assert not kernel.is_supported(*args, backend), (name, backend, q_seq)


def test_the_kernel_slots_scale_reaches_every_kernel(fake_kernels):
    # Gemma: scale = query_pre_attn_scalar ** -0.5, not head_dim ** -0.5.
    from axplug.layers import Attention
    from axplug.modifiers import make_modifier

    args = example_call()
    want = run_layer(DotProductKernel.default_config().set(scale=0.05), args)
    assert not np.allclose(want, run_layer(DotProductKernel.default_config(), args))
    for names in (["xla"], ["reference"]):
        cfg = FlashAttention.default_config().set(scale=0.05, kernels=names)
        assert_close(run_layer(cfg, args), want, F32)
    # The flash_attention modifier keeps the scale the slot had.
    attention = Attention.default_config().set(input_dim=8, num_heads=2)
    attention.kernel.set(scale=0.05)
    flash = make_modifier("flash_attention")(attention)
    assert flash.kernel.klass is FlashAttention and flash.kernel.scale == 0.05


def test_flash_attention_layer_runs_the_chosen_kernel(fake_kernels):
    args = example_call()
    for backend, value in (("tpu", 2.0), ("gpu", 1.0)):
        out = run_layer(FlashAttention.default_config().set(backend=backend), args)
        assert_close(out, jnp.full(args[0].shape, value), F32)
    cfg = FlashAttention.default_config().set(backend="tpu", kernels=["reference"])
    assert_close(run_layer(cfg, args), run_layer(DotProductKernel.default_config(), args), F32)
    lines = describe_kernels(backend="tpu")
    assert any(line.split()[0] == "tpu_only" and line.endswith("chosen") for line in lines)
    assert any("no: needs the gpu backend" in line for line in lines)


def test_flash_attention_rejects_unknown_kernel_names():
    with pytest.raises(ConfigError, match="kernels: no kernel 'warp_drive' is registered"):
        FlashAttention.default_config().set(kernels=["warp_drive"]).instantiate(parent=None)


def test_describe_kernels_names_the_choice_on_this_machine():
    lines = describe_kernels()
    assert jax.default_backend() in lines[0]
    chosen = [line.split()[0] for line in lines[1:] if line.endswith("chosen")]
    # CPU, a 2048-token example: the blockwise kernel outranks XLA, which outranks reference.
    assert chosen == ["blockwise"]
    assert FlashAttention.info_lines() == lines


def test_unsupported_is_false_and_says_why():
    answer = Unsupported("needs bf16")
    assert not answer and answer.reason == "needs bf16"
    q = jnp.zeros((2, 4, 2, 8))
    bad_v = jnp.zeros((2, 4, 2, 4))  # value shape differs from key
    mask = AttentionMask(jnp.zeros((2, 4), jnp.int32), jnp.zeros((2, 4), jnp.int32))
    answer = XlaKernel().is_supported(q, q, bad_v, mask, "cpu")
    assert not answer and "shape" in answer.reason


def test_flash_attention_modifier_is_the_cores():
    # Hardware mesh rules name it, and they depend on the core alone.
    (component,) = [c for c in registry.discover("modifiers") if c.name == "flash_attention"]
    assert component.distribution == "axplug"
    from axplug.layers import Attention, QKVLinear
    from axplug.modifiers import make_modifier

    cfg = Attention.default_config().set(input_dim=8, num_heads=2)
    flash = make_modifier("flash_attention:backend='tpu'")(cfg)
    assert flash.kernel.klass is FlashAttention and flash.kernel.backend == "tpu"
    assert cfg.kernel.klass is DotProductKernel  # never mutates its input
    again = make_modifier("flash_attention:kernels=['xla']")(flash)
    assert again.kernel.kernels == ["xla"] and again.kernel.backend is None
    with pytest.raises(ConfigError, match="modifier 'flash_attention': the config has no"):
        make_modifier("flash_attention")(QKVLinear.default_config())


ALL = (
    "gqa",
    "non_causal",
    "sliding_window",
    "segment_ids",
    "differentiable",
    "linear_bias",
    "logit_softcap",
)


class TestXlaKernelConformance(KernelConformance):
    capabilities = ALL

    @pytest.fixture
    def kernel(self):
        return registry.load("kernels", "xla")()


class TestBlockwiseKernelConformance(KernelConformance):
    capabilities = ALL

    @pytest.fixture
    def kernel(self):
        # Small blocks, every length: the kit's problems span several blocks and a ragged one.
        kernel = registry.load("kernels", "blockwise")()
        kernel.block, kernel.min_kv_len = 16, 0
        return kernel


def test_blockwise_kernel_keeps_memory_linear_in_the_sequence():
    from axplug.kernels import XlaKernel, blockwise_attention

    b, s, h, d = 1, 8192, 8, 64
    q = jax.ShapeDtypeStruct((b, s, h, d), jnp.float32)
    pos = jax.ShapeDtypeStruct((b, s), jnp.int32)

    def temp(attend):
        def loss(q, k, v, pos):
            return jnp.sum(attend(q, k, v, AttentionMask(pos, pos), scale=0.125))

        grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
        return grads.lower(q, q, q, pos).compile().memory_analysis().temp_size_in_bytes

    assert temp(blockwise_attention) < temp(XlaKernel()) / 8


def test_blockwise_kernel_is_dispatched_for_long_sequences_only():
    from axplug.kernels import BlockwiseKernel, select_kernel

    def call(seq):
        x = jax.ShapeDtypeStruct((1, seq, 4, 64), jnp.float32)
        pos = jax.ShapeDtypeStruct((1, seq), jnp.int32)
        return select_kernel(x, x, x, AttentionMask(pos, pos), backend="cpu")[0]

    assert call(BlockwiseKernel.min_kv_len) == "blockwise"
    assert call(BlockwiseKernel.min_kv_len // 4) == "xla"


def test_blockwise_attention_takes_values_of_another_head_dim():
    # MLA: q and k heads of 12 (nope + rope), values of 8; against plain jnp, with gradients.
    from axplug.kernels import blockwise_attention

    b, s, h, kvh, d, dv = 2, 40, 4, 2, 12, 8
    keys = jax.random.split(jax.random.PRNGKey(0), 3)
    q = jax.random.normal(keys[0], (b, s, h, d))
    k = jax.random.normal(keys[1], (b, s, kvh, d))
    v = jax.random.normal(keys[2], (b, s, kvh, dv))
    pos = jnp.broadcast_to(jnp.arange(s), (b, s))
    mask = AttentionMask(pos, pos)

    def plain(q, k, v):
        kk, vv = (jnp.repeat(x, h // kvh, axis=2) for x in (k, v))
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, kk) * 0.3
        scores = jnp.where(jnp.tril(jnp.ones((s, s), bool)), scores, -jnp.inf)
        return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(scores, -1), vv)

    def blocks(q, k, v):
        return blockwise_attention(q, k, v, mask, scale=0.3, block=16)  # 3 blocks, 1 ragged

    # Each side compiled as one program (eagerly, each op would compile on its own: ~100).
    out = jax.jit(blocks)(q, k, v)
    assert out.shape == (b, s, h, dv)
    np.testing.assert_allclose(out, jax.jit(plain)(q, k, v), rtol=1e-5, atol=1e-5)
    loss = lambda f: lambda *a: jnp.sum(jnp.sin(f(*a)))  # noqa: E731
    got = jax.jit(jax.grad(loss(blocks), argnums=(0, 1, 2)))(q, k, v)
    want = jax.jit(jax.grad(loss(plain), argnums=(0, 1, 2)))(q, k, v)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5)
