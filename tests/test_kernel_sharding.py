"""Hardware attention kernels under a sharded mesh: shard_map over the batch (and heads).

Lowering: with 8 fake CPU devices (tests/conftest.py), the Splash kernel lowers for TPU and the
cuDNN and Pallas GPU kernels for CUDA when called the way the Trainer calls them: a jitted
function enters `sharding_scope(mesh, rules)` and runs the `FlashAttention` slot, whose
dispatch picks the kernel for the given backend, on q/k/v sharded as `Attention` lays them out.
Lowering is not compiling: XLA's partitioner runs at compile time, which needs the platform.

The cuDNN kernel reads the cuDNN version at trace time from jax's CUDA plugin
(`jax._src.lib.cuda_versions`); a CPU-only jaxlib has none and raises "cuDNN is not detected",
so here (and only here) that one probe answers a fixed version. Everything else is jax's own
CUDA lowering.

Numerics: kernels run through the same shard_map on 8 CPU devices equal the unsharded
reference, forward and gradients (float32: rtol = atol = 1e-5; gradients 1e-4, as in
tests/test_kernels.py).
"""

from __future__ import annotations

import contextlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from axplug.api import AttentionMask
from axplug.context import functional
from axplug.kernels import (
    ReferenceKernel,
    attention_specs,
    kernel_choices,
    select_kernel,
    shard_over_batch,
)
from axplug.layers import FlashAttention
from axplug.mesh import DEFAULT_AXIS_RULES, MESH_AXES, logical_to_partition_spec
from axplug.sharding import sharding_scope

axplug_gpu = pytest.importorskip("axplug_gpu")
axplug_tpu = pytest.importorskip("axplug_tpu")

F32 = dict(rtol=1e-5, atol=1e-5)
F32_GRAD = dict(rtol=1e-4, atol=1e-4)
Q_AXES = ("batch", "seq", "heads", None)  # how Attention lays out q (k, v: kv_seq unsharded)

MESHES = {  # data, fsdp, expert, seq, model
    "data8": (8, 1, 1, 1, 1),
    "fsdp8": (1, 8, 1, 1, 1),
    "fsdp4_model2": (1, 4, 1, 1, 2),
}


def make_mesh(name: str) -> Mesh:
    shape = MESHES[name] if isinstance(name, str) else name
    return Mesh(np.array(jax.devices()[:8]).reshape(shape), MESH_AXES)


def sharded(mesh, shape, dtype, logical):
    spec = logical_to_partition_spec(logical, DEFAULT_AXIS_RULES, mesh, shape)
    return jax.ShapeDtypeStruct(shape, jnp.dtype(dtype), sharding=NamedSharding(mesh, spec))


def problem(mesh, dtype, *, batch=8, seq=256, heads=4, kv_heads=4, head_dim=128):
    """Sharded q, k, v, positions as ShapeDtypeStructs, laid out as Attention lays them out."""
    q = sharded(mesh, (batch, seq, heads, head_dim), dtype, Q_AXES)
    kv = sharded(mesh, (batch, seq, kv_heads, head_dim), dtype, ("batch", "kv_seq", "heads", None))
    pos = sharded(mesh, (batch, seq), jnp.int32, ("batch", "seq"))
    return q, kv, kv, pos


def flash_step(mesh, backend, *, grad=False):
    """What the Trainer jits: the FlashAttention slot run inside the sharding scope."""
    layer = FlashAttention.default_config().set(backend=backend).instantiate(parent=None)

    def attend(q, k, v, positions):
        mask = AttentionMask(q_positions=positions, kv_positions=positions)
        out, _ = functional(
            layer, prng_key=None, state={}, inputs=(q, k, v, mask), is_training=False
        )
        return out

    def step(q, k, v, positions):
        with sharding_scope(mesh, DEFAULT_AXIS_RULES):
            if not grad:
                return attend(q, k, v, positions)
            loss = lambda q, k, v: jnp.sum(attend(q, k, v, positions).astype(jnp.float32))  # noqa: E731
            return jax.grad(loss, argnums=(0, 1, 2))(q, k, v)

    return step


@contextlib.contextmanager
def lowering_target(mesh: Mesh, kernel: str):
    """The mesh to trace `kernel` with for lowering on a platform this process lacks."""
    if kernel == "pallas_gpu_flash" and jax.default_backend() != "gpu":
        # jax 0.10 lowers Triton for compute capability 9.0 without a GPU; jax 0.11 reads the
        # target GPU from an abstract mesh, and under shard_map its Pallas refs then refuse
        # slicing (measured on jax 0.11.2): there only a GPU process can lower it.
        major, minor = (int(p) for p in jax.__version__.split(".")[:2])
        if (major, minor) >= (0, 11):
            pytest.skip(f"jax {jax.__version__} lowers Pallas Triton kernels only on a GPU")
    yield mesh


def custom_calls(text: str) -> set[str]:
    return set(re.findall(r"stablehlo\.custom_call @([\w$.]+)", text))


def has_manual_region(text: str) -> bool:
    # Shardy writes shard_map as sdy.manual_computation; GSPMD as {manual} shardings.
    return "sdy.manual_computation" in text or "{manual}" in text


@pytest.fixture
def cudnn_probe(monkeypatch):
    """The cuDNN version jax reads at trace time; a fixed one where no CUDA plugin exists."""
    from jax._src.cudnn import fused_attention_stablehlo
    from jax._src.lib import cuda_versions

    if cuda_versions is None:
        monkeypatch.setattr(fused_attention_stablehlo, "check_cudnn_version", lambda: 91000)


LOWERINGS = [
    # (backend, dtype, kernel dispatch picks, custom call target, platform)
    pytest.param("tpu", "bfloat16", "splash", "tpu_custom_call", "tpu", id="splash"),
    pytest.param("cuda", "bfloat16", "cudnn_flash", "__cudnn$fmhaSoftmax", "cuda", id="cudnn"),
    pytest.param(
        "cuda", "float32", "pallas_gpu_flash", "__gpu$xla.gpu.triton", "cuda", id="pallas_gpu"
    ),
]


@pytest.mark.parametrize("mesh_name", list(MESHES))
@pytest.mark.parametrize("backend, dtype, kernel, target, platform", LOWERINGS)
def test_hardware_kernel_lowers_on_a_sharded_batch(
    cudnn_probe, mesh_name, backend, dtype, kernel, target, platform
):
    mesh = make_mesh(mesh_name)
    args = problem(mesh, dtype)
    with sharding_scope(mesh, DEFAULT_AXIS_RULES):
        assert select_kernel(*args[:3], AttentionMask(args[3], args[3]), backend=backend)[0] == (
            kernel
        )
    with lowering_target(mesh, kernel) as lowered_mesh:
        step = flash_step(lowered_mesh, backend)
        traced = jax.jit(step).trace(*problem(lowered_mesh, dtype))
        text = traced.lower(lowering_platforms=(platform,)).as_text()
    assert target in custom_calls(text), custom_calls(text)
    assert has_manual_region(text)


@pytest.mark.parametrize("backend, dtype, kernel, target, platform", LOWERINGS)
def test_hardware_kernel_gradients_lower_on_a_sharded_batch(
    cudnn_probe, backend, dtype, kernel, target, platform
):
    mesh = make_mesh("fsdp4_model2")
    with lowering_target(mesh, kernel) as lowered_mesh:
        step = flash_step(lowered_mesh, backend, grad=True)
        traced = jax.jit(step).trace(*problem(lowered_mesh, dtype))
        text = traced.lower(lowering_platforms=(platform,)).as_text()
    calls = custom_calls(text)
    assert target in calls, calls
    if kernel == "cudnn_flash":
        assert "__cudnn$fmhaSoftmaxBackward" in calls, calls
    assert has_manual_region(text)


def test_splash_without_the_wrapper_fails_as_the_issue_states():
    # The same call without shard_map: Mosaic refuses a sharded operand.
    mesh = make_mesh("data8")
    kernel = axplug_tpu.SplashAttentionKernel()

    def step(q, k, v, positions):
        with sharding_scope(mesh, DEFAULT_AXIS_RULES):
            return kernel.attend(q, k, v, AttentionMask(positions, positions), scale=0.1)

    with pytest.raises(NotImplementedError, match="Mosaic kernels cannot be automatically"):
        jax.jit(step).trace(*problem(mesh, "bfloat16")).lower(lowering_platforms=("tpu",))


@pytest.mark.parametrize(
    "name, kernel, dtype, target",
    [
        ("pallas_gpu_flash", axplug_gpu.PallasGpuFlashKernel(), "float32", "__gpu$xla.gpu.triton"),
        ("cudnn_flash", axplug_gpu.CudnnFlashKernel(), "bfloat16", "CustomSPMDPartitioning"),
    ],
    ids=["pallas_gpu", "cudnn"],
)
def test_gpu_kernels_without_the_wrapper_are_left_to_the_partitioner(
    cudnn_probe, name, kernel, dtype, target
):
    # They lower, but outside any manual region: XLA would replicate the Triton call (every
    # device gathering the whole batch) and hand cuDNN to jax's partitioning callback.
    with lowering_target(make_mesh("data8"), name) as mesh:

        def step(q, k, v, positions):
            with sharding_scope(mesh, DEFAULT_AXIS_RULES):
                return kernel.attend(q, k, v, AttentionMask(positions, positions), scale=0.1)

        traced = jax.jit(step).trace(*problem(mesh, dtype))
        text = traced.lower(lowering_platforms=("cuda",)).as_text()
    assert target in custom_calls(text) and not has_manual_region(text)


def test_sequence_parallel_meshes_fall_back_to_the_xla_kernel():
    mesh = make_mesh((4, 1, 1, 2, 1))  # data 4, seq 2
    q, k, v, pos = problem(mesh, "bfloat16", seq=512)
    mask = AttentionMask(pos, pos)
    why = "sequence sharded over the seq mesh axis (2 ways)"
    for backend, flash in (("tpu", ["splash"]), ("cuda", ["cudnn_flash", "pallas_gpu_flash"])):
        with sharding_scope(mesh, DEFAULT_AXIS_RULES):
            choices = {c.name: c for c in kernel_choices(q, k, v, mask, backend=backend)}
            assert select_kernel(q, k, v, mask, backend=backend)[0] == "xla"
        for name in flash:
            assert why in choices[name].reason, choices[name]
        assert select_kernel(q, k, v, mask, backend=backend)[0] == flash[0]  # outside the scope
    nki = pytest.importorskip("axplug_trainium").NkiFlashKernel()
    with sharding_scope(mesh, DEFAULT_AXIS_RULES):
        assert why in nki._check(q, k, v, mask, "neuron").reason
    assert nki._check(q, k, v, mask, "neuron") is True
    text = jax.jit(flash_step(mesh, "tpu")).trace(q, k, v, pos).lower(lowering_platforms=("tpu",))
    assert "tpu_custom_call" not in text.as_text()


def test_heads_are_split_only_where_the_model_axis_divides_query_and_kv_heads():
    mesh = make_mesh("fsdp4_model2")
    with sharding_scope(mesh, DEFAULT_AXIS_RULES) as scope:
        q = jax.ShapeDtypeStruct((8, 16, 4, 8), jnp.float32)
        gqa = jax.ShapeDtypeStruct((8, 16, 2, 8), jnp.float32)
        mqa = jax.ShapeDtypeStruct((8, 16, 1, 8), jnp.float32)
        assert attention_specs(scope, q, gqa) == (
            PartitionSpec("fsdp", None, "model", None),
            PartitionSpec("fsdp", None, "model", None),
        )
        assert attention_specs(scope, q, mqa) == (
            PartitionSpec("fsdp", None, None, None),
            PartitionSpec("fsdp", None, None, None),
        )


# ------------------------------------------------------------------------------- numerics


def inputs(batch=8, seq=128, heads=4, kv_heads=2, head_dim=16, segments=True):
    """Drawn in numpy: no program compiled per op and shape."""
    rng = np.random.default_rng(0)

    def normal(*shape):
        return jnp.asarray(rng.standard_normal(shape, np.float32))

    q = normal(batch, seq, heads, head_dim)
    k, v = normal(batch, seq, kv_heads, head_dim), normal(batch, seq, kv_heads, head_dim)
    cot = normal(*q.shape)
    pos = np.broadcast_to(np.arange(seq, dtype=np.int32), (batch, seq))
    seg = jnp.asarray((pos >= seq // 3).astype(np.int32)) if segments else None
    pos = jnp.asarray(pos)
    return q, k, v, AttentionMask(pos, pos, seg, seg), cot


def out_and_grads(fn, q, k, v, cot, mesh=None):
    """(out, (dq, dk, dv)) of fn(q, k, v) under jit, inside `mesh`'s scope when given."""

    def both(q, k, v):
        with sharding_scope(mesh, DEFAULT_AXIS_RULES):
            out, vjp = jax.vjp(fn, q, k, v)
            return out, vjp(cot)

    return jax.jit(both)(q, k, v)


def assert_matches(got, want):
    np.testing.assert_allclose(got[0], want[0], **F32)
    for name, g, w in zip("qkv", got[1], want[1], strict=True):
        np.testing.assert_allclose(g, w, **F32_GRAD, err_msg=f"d{name}")


@pytest.mark.parametrize("mesh_name", ["data8", "fsdp4_model2"])
def test_wrapper_keeps_the_reference_numerics(mesh_name):
    q, k, v, mask, cot = inputs()  # GQA, packed sequences
    ref = ReferenceKernel()
    fn = lambda q, k, v: shard_over_batch(ref, q, k, v, mask, scale=0.25)  # noqa: E731
    mesh = make_mesh(mesh_name)
    got = out_and_grads(fn, q, k, v, cot, mesh)
    want = out_and_grads(lambda q, k, v: ref(q, k, v, mask, scale=0.25), q, k, v, cot)
    assert_matches(got, want)
    with sharding_scope(mesh, DEFAULT_AXIS_RULES):
        text = jax.jit(fn).lower(q, k, v).as_text()
    assert has_manual_region(text)


@pytest.mark.parametrize("mesh_name", ["data8", "fsdp4_model2"])
def test_pallas_gpu_kernel_through_the_wrapper_matches_the_reference(mesh_name):
    # The Triton kernel's Pallas program in the interpreter, on each device's rows (and heads).
    q, k, v, mask, cot = inputs(heads=2, kv_heads=2)
    kernel = axplug_gpu.PallasGpuFlashKernel()
    kernel.interpret = True
    fn = lambda q, k, v: kernel(q, k, v, mask, scale=0.25)  # noqa: E731
    got = out_and_grads(fn, q, k, v, cot, make_mesh(mesh_name))
    ref = lambda q, k, v: ReferenceKernel()(q, k, v, mask, scale=0.25)  # noqa: E731
    assert_matches(got, out_and_grads(ref, q, k, v, cot))


def test_inside_a_shard_map_the_wrapper_is_a_plain_call():
    mesh = make_mesh("data8")
    q, k, v, mask, _ = inputs(segments=False)
    seen = []

    def record(q, k, v, mask, *, scale):
        seen.append(q.shape)
        return ReferenceKernel()(q, k, v, mask, scale=scale)

    def per_device(q, k, v, mask):
        with sharding_scope(mesh, DEFAULT_AXIS_RULES):
            return shard_over_batch(record, q, k, v, mask, scale=0.25)

    rows = PartitionSpec("data")
    fn = jax.shard_map(per_device, mesh=mesh, in_specs=rows, out_specs=rows)
    out = jax.jit(fn)(q, k, v, mask)
    assert seen == [(1, 128, 4, 16)]  # one device's rows, not wrapped again
    want = jax.jit(lambda q, k, v, mask: ReferenceKernel()(q, k, v, mask, scale=0.25))
    np.testing.assert_allclose(out, want(q, k, v, mask), **F32)


@pytest.mark.parametrize("mesh_name", ["data8", "fsdp4_model2"])
def test_bias_slopes_are_split_with_the_heads(mesh_name):
    # ALiBi under the wrapper: on fsdp4_model2 each device holds 2 of the 4 query heads, so
    # it must get those heads' slopes (a wrong split biases every head like head 0).
    import dataclasses

    q, k, v, mask, cot = inputs(kv_heads=4)
    mask = dataclasses.replace(mask, linear_bias_slopes=jnp.asarray([1.0, 0.5, 0.25, 0.125]))
    ref = ReferenceKernel()
    fn = lambda q, k, v: shard_over_batch(ref, q, k, v, mask, scale=0.25)  # noqa: E731
    got = out_and_grads(fn, q, k, v, cot, make_mesh(mesh_name))
    assert_matches(got, out_and_grads(lambda q, k, v: ref(q, k, v, mask, scale=0.25), q, k, v, cot))


def test_cudnn_takes_the_bias_and_lowers_on_a_sharded_batch(cudnn_probe):
    mesh = make_mesh("fsdp4_model2")
    q, k, v, pos = problem(mesh, "bfloat16")
    slopes = tuple(2.0 ** (-8.0 * i / 4) for i in range(1, 5))
    layer = FlashAttention.default_config().set(backend="cuda").instantiate(parent=None)

    def step(q, k, v, positions):
        with sharding_scope(mesh, DEFAULT_AXIS_RULES):
            mask = AttentionMask(positions, positions, linear_bias_slopes=jnp.asarray(slopes))
            assert select_kernel(q, k, v, mask, backend="cuda")[0] == "cudnn_flash"
            out, _ = functional(
                layer, prng_key=None, state={}, inputs=(q, k, v, mask), is_training=False
            )
            return out

    text = jax.jit(step).trace(q, k, v, pos).lower(lowering_platforms=("cuda",)).as_text()
    assert "__cudnn$fmhaScaleBiasSoftmax" in custom_calls(text), custom_calls(text)
    assert has_manual_region(text)
