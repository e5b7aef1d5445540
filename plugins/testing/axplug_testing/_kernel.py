"""`KernelConformance`: an attention kernel checked against the reference attention."""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from axplug.api import Kernel, why_unsupported
from axplug.registry import conformed
from axplug_testing._util import TraceCounter, assert_finite, require

__all__ = [
    "KERNEL_CAPABILITIES",
    "DEFAULT_CAPABILITIES",
    "KernelConformance",
    "reference_kernel",
    "alibi_slopes",
    "abstract_call",
]


def declared_kernel(kernel: Any) -> Kernel:
    """The kernel as dispatch reads it: its optional members, or `Kernel`'s defaults."""
    return conformed(kernel, Kernel)


def skip_unless_supported(kernel: Any, *call: Any) -> None:
    """Skips the test when the kernel declines `call` (its arguments, then the backend)."""
    answer = declared_kernel(kernel).is_supported(*call)
    if not answer:
        pytest.skip(f"not supported here: {why_unsupported(answer)}")


KERNEL_CAPABILITIES = (
    "gqa",  # fewer kv heads than query heads
    "non_causal",  # causal=False masks
    "sliding_window",  # AttentionMask.sliding_window
    "segment_ids",  # packed sequences: q/kv segment ids
    "differentiable",  # gradients match the reference's
    "linear_bias",  # AttentionMask.linear_bias_slopes (ALiBi); plugin API 1.1
    "logit_softcap",  # AttentionMask.logit_softcap (Gemma 2's score soft-capping)
)
# What a kernel that declares nothing is checked for: the plugin API 1.0 features. A new
# capability is opt-in, so kernels written before it keep passing.
DEFAULT_CAPABILITIES = KERNEL_CAPABILITIES[:5]


class Case(NamedTuple):
    """One attention problem: shapes and the static fields of its mask."""

    batch: int = 2
    q_len: int = 16
    kv_len: int = 16
    heads: int = 4
    kv_heads: int = 4
    head_dim: int = 8
    causal: bool = True
    window: int | None = None
    segments: bool = False
    bias: bool = False  # ALiBi slopes on the mask
    softcap: float | None = None  # the mask's logit_softcap
    needs: tuple[str, ...] = ()


CASES = {
    "mha_causal": Case(),
    "gqa": Case(kv_heads=2, needs=("gqa",)),
    "mqa": Case(kv_heads=1, needs=("gqa",)),
    "non_causal": Case(causal=False, needs=("non_causal",)),
    "sliding_window": Case(window=4, needs=("sliding_window",)),
    "segments": Case(segments=True, needs=("segment_ids",)),
    "alibi": Case(bias=True, needs=("linear_bias",)),
    "alibi_gqa_decode": Case(q_len=1, kv_heads=2, bias=True, needs=("linear_bias", "gqa")),
    # A cap near the scores' scale (about 1 here), so tanh bends them.
    "softcap": Case(softcap=1.0, needs=("logit_softcap",)),
    "softcap_gqa_window_decode": Case(
        q_len=1, kv_heads=2, window=6, softcap=0.5, needs=("logit_softcap", "gqa", "sliding_window")
    ),
}


def reference_kernel() -> Any:
    """The core's reference attention kernel (`axplug.kernels.ReferenceKernel`)."""
    from axplug.kernels import ReferenceKernel

    return ReferenceKernel()


def make_problem(case: Case, dtype=jnp.float32, seed: int = 0):
    """(query, key, value, mask) for `case`, random but deterministic (drawn with numpy: jax
    ops run one by one would compile a program each per shape)."""
    from axplug.api import AttentionMask

    rng = np.random.default_rng(seed)
    q_shape = (case.batch, case.q_len, case.heads, case.head_dim)
    kv_shape = (case.batch, case.kv_len, case.kv_heads, case.head_dim)
    q, k, v = (
        jnp.asarray(rng.standard_normal(shape).astype(np.float32), dtype)
        for shape in (q_shape, kv_shape, kv_shape)
    )
    q_pos = np.broadcast_to(np.arange(case.q_len) + case.kv_len - case.q_len, q_shape[:2])
    kv_pos = np.broadcast_to(np.arange(case.kv_len), kv_shape[:2])
    seg_q = seg_kv = None
    if case.segments:  # two packed documents per row
        seg_q = jnp.asarray(q_pos >= case.kv_len // 2, jnp.int32)
        seg_kv = jnp.asarray(kv_pos >= case.kv_len // 2, jnp.int32)
    mask = AttentionMask(
        q_positions=jnp.asarray(q_pos, jnp.int32),
        kv_positions=jnp.asarray(kv_pos, jnp.int32),
        q_segment_ids=seg_q,
        kv_segment_ids=seg_kv,
        causal=case.causal,
        sliding_window=case.window,
        linear_bias_slopes=alibi_slopes(case.heads) if case.bias else None,
        logit_softcap=case.softcap,
    )
    return q, k, v, mask


def alibi_slopes(heads: int) -> jax.Array:
    """ALiBi's geometric slopes 2^(-8 i / heads), i = 1..heads (for the bias cases)."""
    return jnp.asarray([2.0 ** (-8.0 * i / heads) for i in range(1, heads + 1)], jnp.float32)


# The default reference's outputs and gradients, by (what, case, dtype): the same for every
# kernel class checked in this process, computed once.
_REFERENCE_RESULTS: dict[tuple, Any] = {}


def _reference_result(reference: Any, key: tuple, compute: Any) -> Any:
    """`compute()`, remembered under `key` when `reference` is the core's (stateless) default."""
    from axplug.kernels import ReferenceKernel

    if type(reference) is not ReferenceKernel:
        return compute()
    if key not in _REFERENCE_RESULTS:
        _REFERENCE_RESULTS[key] = compute()
    return _REFERENCE_RESULTS[key]


class NumericsFixtures:
    """`dtype` (float32) and `tolerance` fixtures of the kernel kits: `float32_tolerance`
    against a float32 reference, 2e-2 for 16-bit dtypes (override either fixture)."""

    float32_tolerance = 1e-5

    @pytest.fixture
    def dtype(self):
        return jnp.float32

    @pytest.fixture
    def tolerance(self, dtype) -> dict:
        if jnp.dtype(dtype) == jnp.float32:
            return {"rtol": self.float32_tolerance, "atol": self.float32_tolerance}
        return {"rtol": 2e-2, "atol": 2e-2}


class KernelConformance(NumericsFixtures):
    """Subclass as `TestMyKernel(KernelConformance)` and override the `kernel` fixture.

    `kernel` returns an object with `__call__(query, key, value, mask, *, scale)` (and
    optionally `is_supported(query, key, value, mask, backend)`), the protocol of
    `axplug.api.AttentionKernel`. Optional fixtures: `reference` (default
    `reference_kernel()`), `tolerance`, `dtype`. Declare in `capabilities` which mask features
    and layouts the kernel supports (default `DEFAULT_CAPABILITIES`, the plugin API 1.0 set;
    add "linear_bias" with `supports_linear_bias = True` on the kernel, "logit_softcap" with
    `supports_logit_softcap = True`).

    The `reference` fixture is what every case is compared with: any object with the kernel
    protocol's `__call__`; override it for a kernel whose numerics legitimately differ (a
    quantized kernel against a quantized reference).
    """

    capabilities: tuple[str, ...] = DEFAULT_CAPABILITIES

    @pytest.fixture
    def kernel(self):
        raise NotImplementedError(
            f"{type(self).__name__}: override the `kernel` fixture to return your kernel"
        )

    @pytest.fixture
    def reference(self):
        return reference_kernel()

    def _case(self, name: str) -> Case:
        case = CASES[name]
        for capability in case.needs:
            require(self, capability, KERNEL_CAPABILITIES)
        return case

    def _check_supported(self, kernel, problem) -> None:
        answer = declared_kernel(kernel).is_supported(*problem, jax.default_backend())
        assert answer, (
            f"{type(kernel).__name__}.is_supported says {answer!r} for a case its "
            "capabilities declare; drop the capability or support the case"
        )

    def test_capabilities_are_known(self):
        unknown = set(self.capabilities) - set(KERNEL_CAPABILITIES)
        assert not unknown, f"unknown capabilities {sorted(unknown)}; known: {KERNEL_CAPABILITIES}"

    @pytest.mark.parametrize("capability", ["linear_bias", "logit_softcap"])
    def test_capability_matches_the_kernel_attribute(self, kernel, capability):
        declared = capability in self.capabilities
        attribute = getattr(declared_kernel(kernel), f"supports_{capability}")
        assert declared == attribute, (
            f"capabilities {'include' if declared else 'omit'} {capability!r} but the kernel's "
            f"supports_{capability} is {attribute}: dispatch reads the attribute"
        )

    @pytest.mark.parametrize("case_name", list(CASES))
    def test_matches_reference(self, kernel, reference, case_name, dtype, tolerance):
        case = self._case(case_name)
        problem = make_problem(case, dtype)
        self._check_supported(kernel, problem)
        scale = 1.0 / math.sqrt(case.head_dim)
        got = jax.jit(lambda q, k, v, m: kernel(q, k, v, m, scale=scale))(*problem)
        assert got.shape == problem[0].shape, f"output {got.shape} != query {problem[0].shape}"
        assert got.dtype == problem[2].dtype, (
            f"output dtype {got.dtype} != value {problem[2].dtype}"
        )
        assert_finite(got, "kernel output")
        f32 = [x.astype(jnp.float32) if hasattr(x, "astype") else x for x in problem[:3]]
        want = _reference_result(
            reference,
            ("output", case_name, jnp.dtype(dtype).name),
            lambda: jax.jit(lambda q, k, v, m: reference(q, k, v, m, scale=scale))(
                *f32, problem[3]
            ),
        )
        np.testing.assert_allclose(
            np.asarray(got, np.float32), np.asarray(want, np.float32), **tolerance
        )

    def test_jit_traces_once(self, kernel, dtype):
        case = CASES["mha_causal"]
        q, k, v, mask = make_problem(case, dtype)
        counter = TraceCounter(lambda q, k, v, m: kernel(q, k, v, m, scale=0.5))
        fn = jax.jit(counter)
        fn(q, k, v, mask)
        fn(q + 1, k, v * 2, mask)
        assert counter.count == 1, f"the kernel was traced {counter.count} times for one shape"

    @pytest.mark.parametrize("case_name", ["mha_causal", "softcap"])
    def test_gradients_match_reference(self, kernel, reference, dtype, tolerance, case_name):
        require(self, "differentiable", KERNEL_CAPABILITIES)
        case = self._case(case_name)
        q, k, v, mask = make_problem(case, dtype)

        def loss(fn, q, k, v):
            return jnp.sum(jnp.square(fn(q, k, v, mask, scale=0.25).astype(jnp.float32)))

        got = jax.jit(jax.grad(lambda *a: loss(kernel, *a), argnums=(0, 1, 2)))(q, k, v)
        want = _reference_result(
            reference,
            ("gradients", case_name, jnp.dtype(dtype).name),
            lambda: jax.jit(jax.grad(lambda *a: loss(reference, *a), argnums=(0, 1, 2)))(
                q.astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32)
            ),
        )
        for name, g, w in zip("qkv", got, want, strict=True):
            assert_finite(g, f"d{name}")
            np.testing.assert_allclose(
                np.asarray(g, np.float32),
                np.asarray(w, np.float32),
                **tolerance,
                err_msg=f"gradient wrt {name}",
            )


def abstract_call(
    dtype="bfloat16", *, seq=2048, heads=8, kv_heads=8, head_dim=128, q_seq=None, **mask
):
    """(query, key, value, mask) as `jax.ShapeDtypeStruct`s, for asking a kernel's
    `is_supported` (or dispatch) about a call without making arrays; `segments=True` adds
    segment ids, other keywords are `AttentionMask` fields."""
    from axplug.api import AttentionMask

    q = jax.ShapeDtypeStruct((2, q_seq or seq, heads, head_dim), jnp.dtype(dtype))
    kv = jax.ShapeDtypeStruct((2, seq, kv_heads, head_dim), jnp.dtype(dtype))
    qpos = jax.ShapeDtypeStruct((2, q_seq or seq), jnp.int32)
    kpos = jax.ShapeDtypeStruct((2, seq), jnp.int32)
    if mask.pop("segments", False):
        mask.update(q_segment_ids=qpos, kv_segment_ids=qpos if q_seq is None else kpos)
    return q, kv, kv, AttentionMask(q_positions=qpos, kv_positions=kpos, **mask)  # type: ignore[arg-type]
