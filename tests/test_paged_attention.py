"""Paged attention: kernels that read a paged KV cache's pages in place, and their dispatch."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from axplug_testing import PagedKernelConformance, make_paged_problem, paged_reference

from axplug.kernels import kernel_choices, paged_attention_xla, select_paged_kernel
from axplug.kernels.paged import XlaPagedKernel
from axplug.sharding import sharding_scope


@functools.partial(jax.jit, static_argnums=2, static_argnames="logit_softcap")
def _reference(query, paged, scale, logit_softcap=None):
    return paged_reference(query, paged, scale=scale, logit_softcap=logit_softcap)


def reference(query, paged, scale, logit_softcap=None):
    """`paged_reference`, compiled: one program per shape, not one per op."""
    return np.asarray(_reference(query, paged, scale, logit_softcap=logit_softcap))


class TestXlaPagedKernel(PagedKernelConformance):
    @pytest.fixture
    def kernel(self):
        return XlaPagedKernel()


class TestPallasGpuPagedKernelInTheInterpreter(PagedKernelConformance):
    @pytest.fixture
    def kernel(self):
        axplug_gpu = pytest.importorskip("axplug_gpu")
        kernel = axplug_gpu.PallasGpuPagedKernel()
        kernel.interpret = True
        kernel.is_supported = lambda *args: True  # gated to CUDA; the interpreter runs anywhere
        return kernel


@pytest.mark.parametrize("blocks", [1, 2, 8])
def test_xla_paged_kernel_equals_attention_over_the_gathered_rows(blocks):
    query, paged = make_paged_problem()
    attend = jax.jit(lambda q, p: paged_attention_xla(q, p, scale=0.3, pages_per_block=blocks))
    got = attend(query, paged)
    np.testing.assert_allclose(got, reference(query, paged, 0.3), rtol=1e-5, atol=1e-5)


def test_a_pool_in_row_order_is_read_without_gathering_and_gives_the_same_attention():
    """A table in row order (a contiguous cache's, or pages given in order) takes the reshape
    branch; the same pool under a shuffled table the gathering loop: both equal the reference."""
    query, paged = make_paged_problem(page=4, pages_per_row=3)
    b, per_row = paged.block_table.shape
    rng = np.random.default_rng(1)
    pool = (rng.normal(size=(paged.key_pages.shape[0], b * per_row, 4, query.shape[-1])),) * 2
    lengths = jnp.asarray(rng.integers(1, per_row * 4 + 1, b), jnp.int32)
    in_order = jnp.arange(b * per_row, dtype=jnp.int32).reshape(b, per_row)
    shuffled = jnp.asarray(rng.permutation(b * per_row).reshape(b, per_row), jnp.int32)
    attend = jax.jit(lambda q, p: paged_attention_xla(q, p, scale=0.3, pages_per_block=2))
    for table in (in_order, shuffled):
        problem = paged._replace(key_pages=jnp.asarray(pool[0], jnp.float32),
                                 value_pages=jnp.asarray(pool[1] * 2, jnp.float32),
                                 block_table=table, lengths=lengths)  # fmt: skip
        got = attend(query, problem)
        np.testing.assert_allclose(got, reference(query, problem, 0.3), rtol=1e-5, atol=1e-5)
    assert " cond[" in jax.make_jaxpr(attend)(query, problem).pretty_print()  # the branch


def test_xla_paged_kernel_reads_only_blocks_that_hold_tokens():
    query, paged = make_paged_problem(page=4, pages_per_row=8)
    # Values past every row's first page are NaN: a kernel that read them would return NaN
    # (masked scores give them weight 0, and 0 * NaN is NaN).
    short = paged._replace(lengths=jnp.minimum(paged.lengths, 4))
    want = reference(query, short, 0.3)
    table = np.asarray(short.block_table)
    poisoned = np.asarray(short.value_pages).copy()
    first = set(table[:, 0])
    for p in range(poisoned.shape[1]):
        if p not in first:
            poisoned[:, p] = np.nan
    short = short._replace(value_pages=jnp.asarray(poisoned))
    got = jax.jit(lambda q, p: paged_attention_xla(q, p, scale=0.3, pages_per_block=1))(
        query, short
    )
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_paged_dispatch_picks_by_backend_and_says_why_not():
    query, paged = make_paged_problem(head_dim=16)
    assert select_paged_kernel(query, paged, backend="cpu")[0] == "paged_xla"
    names = [name for name, _ in _registered_paged()]
    if "pallas_gpu_paged" in names:
        assert select_paged_kernel(query, paged, backend="gpu")[0] == "pallas_gpu_paged"
        with sharding_scope(_mesh(2)):  # a Pallas call is opaque to XLA: declined on a mesh
            assert select_paged_kernel(query, paged, backend="gpu")[0] == "paged_xla"
    if "pallas_tpu_paged" in names:
        assert select_paged_kernel(query, paged, backend="tpu")[0] == "paged_xla"  # d=16
        wide = make_paged_problem(head_dim=128, page=8)
        assert select_paged_kernel(*wide, backend="tpu")[0] == "pallas_tpu_paged"
        reasons = {n: a for n, _, a in _choices(*wide, backend="cpu")}
        assert "needs the TPU backend" in reasons["pallas_tpu_paged"].reason
    # Dense dispatch never offers a paged kernel, and paged dispatch no dense one.
    q = jax.ShapeDtypeStruct((1, 8, 4, 16), jnp.float32)
    kv = jax.ShapeDtypeStruct((1, 8, 2, 16), jnp.float32)
    from axplug.api import AttentionMask

    pos = jax.ShapeDtypeStruct((1, 8), jnp.int32)
    dense = {c.name for c in kernel_choices(q, kv, kv, AttentionMask(pos, pos), backend="cpu")}
    assert not dense & set(names) and "xla" in dense and "xla" not in names


def test_paged_dispatch_gives_a_softcap_only_to_kernels_that_declare_it():
    query, paged = make_paged_problem(head_dim=128, page=8)
    for backend in ("cpu", "gpu", "tpu"):
        name, kernel = select_paged_kernel(query, paged, backend=backend, logit_softcap=0.5)
        assert getattr(kernel, "supports_logit_softcap", False), (backend, name)
        choices = _choices(query, paged, backend, logit_softcap=0.5)
        for choice_name, choice, answer in choices:
            if not getattr(choice, "supports_logit_softcap", False):
                assert not answer and "supports_logit_softcap" in answer.reason, choice_name
    # The fallback caps: softcap(q k^T * scale) before the softmax.
    got = jax.jit(lambda q, p: paged_attention_xla(q, p, scale=0.3, logit_softcap=0.5))(
        query, paged
    )
    want = reference(query, paged, 0.3, logit_softcap=0.5)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    assert not np.allclose(want, reference(query, paged, 0.3), rtol=1e-3, atol=1e-3)


def _registered_paged():
    from axplug.kernels import registered_kernels

    return registered_kernels(paged=True)


def _choices(query, paged, backend, **kwargs):
    from axplug.kernels.paged import paged_kernel_choices

    return paged_kernel_choices(query, paged, backend=backend, **kwargs)


def _mesh(n):
    from jax.sharding import Mesh

    return Mesh(np.array(jax.devices()[:n]), ("model",))


def test_pallas_gpu_paged_kernel_is_gated_to_cuda():
    axplug_gpu = pytest.importorskip("axplug_gpu")
    query, paged = make_paged_problem(head_dim=16)
    kernel = axplug_gpu.PallasGpuPagedKernel()
    assert "needs a CUDA GPU" in kernel.is_supported(query, paged, "cpu").reason
    assert kernel.is_supported(query, paged, "gpu") is True
    odd = make_paged_problem(head_dim=12)
    assert "not a multiple of 16" in kernel.is_supported(*odd, "gpu").reason


def _small_gpt():
    """gpt-tiny's model (2 layers, 4 heads) at dim 32 and a 64-wide MLP: quicker to decode."""
    from axplug.presets import preset_config

    cfg = preset_config("gpt-tiny").model
    cfg.decoder.dim = 32
    cfg.decoder.transformer.layer.feed_forward.hidden_dim = 64
    return cfg


def _greedy_tokens(cfg, params):
    """The greedy tokens an engine of `cfg`'s model (2 rows of 32) decodes for one prompt."""
    from axplug.inference import Engine, Request, SamplingParams

    engine = Engine(cfg.instantiate(parent=None), params, num_slots=2, max_len=32)
    engine.submit(Request([1, 2, 3, 4, 5], SamplingParams(max_new_tokens=6, temperature=0)))
    return engine.run()[0].output_ids


@functools.cache
def _dense_tokens(softcap):
    """`_small_gpt`'s tokens (attention scores capped at `softcap`, or not) through the dense
    path (a sliding window longer than any sequence here changes no score, but forces it) over
    a contiguous cache: the reference of the cases below (a cache only changes where keys
    live), decoded once."""
    dense = _small_gpt()
    dense.decoder.transformer.layer.attention.set(sliding_window=64, logit_softcap=softcap)
    params = dense.instantiate(parent=None).initialize_parameters_recursively(jax.random.PRNGKey(0))
    return params, _greedy_tokens(dense, params)


@pytest.mark.parametrize(
    "cache, softcap",
    [("contiguous", None), ("paged", 0.2)],
    ids=["contiguous", "paged-softcapped"],
)
def test_decode_steps_read_the_cache_in_place_with_the_paged_kernel(monkeypatch, cache, softcap):
    """Both caches hand their pages (a contiguous row is a run of pages) to the paged kernel
    in decode steps, with the tokens of the dense path; a soft-capped model's steps hand it the
    cap too (an uncapped one's none). The cap rides on the harder cache: an uncapped paged
    cache's decoding is test_inference's paged cases'."""
    from axplug.modifiers import make_modifier

    calls, caps = [], []
    original = XlaPagedKernel.__call__

    def spy(self, query, paged, *, scale, logit_softcap=None):
        calls.append(query.shape)
        caps.append(logit_softcap)
        return original(self, query, paged, scale=scale, logit_softcap=logit_softcap)

    monkeypatch.setattr(XlaPagedKernel, "__call__", spy)
    params, want = _dense_tokens(softcap)  # the same parameters: the cache adds none
    assert not calls
    cfg = _small_gpt()
    cfg.decoder.transformer.layer.attention.logit_softcap = softcap
    if cache == "paged":
        cfg = make_modifier("paged_kv_cache:page_size=4")(cfg)
    assert _greedy_tokens(cfg, params) == want
    # Traced once: every layer of the decode program (width 1) calls it, the prefill's none.
    heads = cfg.decoder.transformer.layer.attention.num_heads
    assert len(calls) == cfg.decoder.transformer.num_layers and calls[0][:2] == (2, heads)
    assert set(caps) == {softcap}
