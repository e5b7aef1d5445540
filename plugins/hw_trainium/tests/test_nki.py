"""axplug-trainium's NKI flash kernel: its gate without the Neuron packages, and its
custom_vjp wiring with jnp stand-ins for flash_fwd / flash_attn_bwd, against the reference."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

axplug_trainium = pytest.importorskip("axplug_trainium")

from axplug_testing import abstract_call  # noqa: E402

from axplug.api import (
    AttentionMask,  # noqa: E402
    registry,  # noqa: E402
)
from axplug.api.kernels import ReferenceKernel, select_kernel  # noqa: E402
from axplug.api.sharding import sharding_scope  # noqa: E402

if "nki_flash" not in registry.names("kernels"):
    # Installed but not loaded (AXPLUG_LOAD_PLUGINS / AXPLUG_DISABLE_PLUGINS): the core alone.
    pytest.skip("axplug-trainium is disabled", allow_module_level=True)


def _chosen(backend, *args):
    return select_kernel(*args, backend=backend)[0]


def test_nki_gate_without_the_neuron_packages():
    kernel = axplug_trainium.NkiFlashKernel()
    assert kernel._check(*abstract_call(), "neuron") is True
    assert kernel._check(*abstract_call(kv_heads=2), "neuron") is True
    assert "bfloat16" in kernel._check(*abstract_call("float32"), "neuron").reason
    assert "512" in kernel._check(*abstract_call(seq=1000), "neuron").reason
    assert "sliding" in kernel._check(*abstract_call(sliding_window=64), "neuron").reason
    assert "neuron backend" in kernel._check(*abstract_call(), "gpu").reason
    # Without jax-neuronx the dispatch falls back and says why.
    assert _chosen("neuron", *abstract_call()) == "blockwise"


# --- the NKI custom_vjp wiring, with jnp stand-ins for flash_fwd / flash_attn_bwd -----------


@dataclasses.dataclass(frozen=True)
class FakeFlashConfig:
    """neuronxcc's FlashConfig fields."""

    seq_tile_size: int = 2048
    training: bool = True
    should_transpose_v: bool = False


def _fake_logits(q, k, causal, scale):
    # q, k: [b, h, d, s] -> scores [b, h, sq, sk] in float32, masked by index.
    logits = jnp.einsum("bhdq,bhdk->bhqk", q, k, preferred_element_type=jnp.float32) * scale
    if causal:
        s = logits.shape[-1]
        logits = jnp.where(jnp.tril(jnp.ones((s, s), bool)), logits, -9984.0)
    return logits


def fake_flash_fwd(q, k, v, seed, softmax_scale=None, use_causal_mask=True,
                   mixed_precision=True, dropout_p=0.0, config=None):  # fmt: skip
    """flash_fwd's contract: q, k [b, h, d, s], v [b, h, s, d] -> o [b, h, s, d] and, in
    training, lse [b, h, 128, s // 128] float32 with query tile*128 + row at [.., row, tile]."""
    b, h, d, s = q.shape
    assert seed.shape == (1,) and dropout_p == 0.0 and mixed_precision
    assert config.training and s % config.seq_tile_size == 0 and config.seq_tile_size >= 512
    logits = _fake_logits(q, k, use_causal_mask, softmax_scale)
    lse = jax.nn.logsumexp(logits, axis=-1)  # [b, h, s]
    o = jnp.einsum("bhqk,bhkd->bhqd", jnp.exp(logits - lse[..., None]), v.astype(jnp.float32))
    return o.astype(q.dtype), lse.reshape(b, h, s // 128, 128).transpose(0, 1, 3, 2)


def fake_flash_attn_bwd(q, k, v, o, dy, lse, seed, use_causal_mask=False,
                        mixed_precision=False, dropout_p=0.0, softmax_scale=None):  # fmt: skip
    """flash_attn_bwd's contract: q, k, v, o, dy [b, h, d, s], lse as flash_fwd wrote it ->
    dq, dk, dv [b, h, d, s]."""
    b, h, d, s = q.shape
    assert lse.shape == (b, h, 128, s // 128) and lse.dtype == jnp.float32 and mixed_precision
    lse = lse.transpose(0, 1, 3, 2).reshape(b, h, s)
    f32 = [x.astype(jnp.float32) for x in (q, k, v, o, dy)]
    q, k, v, o, dy = f32
    p = jnp.exp(_fake_logits(q, k, use_causal_mask, softmax_scale) - lse[..., None])
    dv = jnp.einsum("bhqk,bhdq->bhdk", p, dy)
    dp = jnp.einsum("bhdq,bhdk->bhqk", dy, v)
    ds = p * (dp - jnp.sum(dy * o, axis=2)[..., None])
    dq = jnp.einsum("bhqk,bhdk->bhdq", ds, k) * softmax_scale
    dk = jnp.einsum("bhqk,bhdq->bhdk", ds, q) * softmax_scale
    return dq, dk, dv


def fake_nki_call(kernel, *args, grid, out_shape):
    """nki_call: launches `kernel` on a (batch, heads) grid; outputs must match out_shape."""
    assert grid == args[0].shape[:2], grid
    outs = kernel(*args)
    for out, want in zip(outs, out_shape, strict=True):
        assert (out.shape, out.dtype) == (want.shape, want.dtype), (out.shape, want)
    return outs


@pytest.fixture
def fake_nki():
    from axplug_trainium.kernels import NkiKernels

    kernel = axplug_trainium.NkiFlashKernel()
    kernel.nki = NkiKernels(fake_nki_call, fake_flash_fwd, fake_flash_attn_bwd, FakeFlashConfig)
    return kernel


def test_nki_is_gated_on_both_kernels_and_nki_call():
    kernel = axplug_trainium.NkiFlashKernel()
    assert kernel.nki is None  # jax-neuronx / neuronx-cc are not installed here
    answer = kernel.is_supported(*abstract_call(), "neuron")
    assert not answer and "jax-neuronx / neuronx-cc not importable" in answer.reason
    q = jnp.zeros((1, 512, 2, 16), jnp.bfloat16)
    mask = AttentionMask(jnp.zeros((1, 512), jnp.int32), jnp.zeros((1, 512), jnp.int32))
    with pytest.raises(RuntimeError, match="NkiFlashKernel cannot run here: jax-neuronx"):
        kernel(q, q, q, mask, scale=0.25)


def test_nki_seq_tile_divides_the_sequence():
    from axplug_trainium.kernels import _seq_tile

    assert [_seq_tile(s) for s in (512, 1024, 1536, 2048, 3072, 4096)] == [
        512, 1024, 512, 2048, 1024, 2048
    ]  # fmt: skip


@pytest.mark.parametrize(
    "causal, kv_heads, mesh_shape",
    [(True, 4, None), (False, 4, None), (True, 2, None), (False, 2, None), (True, 2, (2, 2))],
    ids=["causal", "full", "causal_gqa", "full_gqa", "causal_gqa_fsdp2_model2"],
)
def test_nki_forward_and_backward_wiring_matches_the_reference(
    fake_nki, causal, kv_heads, mesh_shape
):
    ks = jax.random.split(jax.random.PRNGKey(1), 4)
    q = jax.random.normal(ks[0], (2, 512, 4, 16), jnp.float32)
    k = jax.random.normal(ks[1], (2, 512, kv_heads, 16), jnp.float32)
    v = jax.random.normal(ks[2], (2, 512, kv_heads, 16), jnp.float32)
    cot = jax.random.normal(ks[3], q.shape, jnp.float32)
    pos = jnp.broadcast_to(jnp.arange(512, dtype=jnp.int32), (2, 512))
    mask = AttentionMask(pos, pos, causal=causal)

    mesh = None
    if mesh_shape is not None:  # through shard_over_batch: batch over fsdp, heads over model
        devices = np.array(jax.devices()[:4]).reshape(1, mesh_shape[0], 1, 1, mesh_shape[1])
        mesh = jax.sharding.Mesh(devices, ("data", "fsdp", "expert", "seq", "model"))

    def out_and_grads(kernel):
        def f(q, k, v):
            with sharding_scope(mesh):
                out, vjp = jax.vjp(lambda q, k, v: kernel(q, k, v, mask, scale=0.25), q, k, v)
                return out, vjp(cot)

        return jax.jit(f)(q, k, v)

    got, got_grads = out_and_grads(fake_nki)
    want, want_grads = out_and_grads(ReferenceKernel())
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    for name, g, w in zip("qkv", got_grads, want_grads, strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-4, err_msg=f"d{name}")
