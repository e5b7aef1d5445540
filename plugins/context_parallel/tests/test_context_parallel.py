"""Context-parallel attention on 8 fake devices against the unsharded reference: values and
gradients, causal, sliding window, packed segments, GQA, soft-capping; the ring's work per
device; the modifier and its errors."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from axplug_context_parallel import ContextParallelAttention, Skip, ring_attention, ring_work
from jax.sharding import Mesh, PartitionSpec

from axplug.api import AttentionMask
from axplug.api.config import ConfigError, find_configs
from axplug.api.kernels import BlockwiseKernel, reference_attention, select_kernel
from axplug.api.layers import Attention, FlashAttention, functional
from axplug.api.registry import load
from axplug.api.sharding import MESH_AXES, sharding_scope

SEQ8 = (1, 1, 1, 8, 1)  # data, fsdp, expert, seq, model


def mesh_of(shape) -> Mesh:
    return Mesh(np.array(jax.devices()[:8]).reshape(shape), MESH_AXES)


def packed(rng, batch: int, seq: int):
    """Segment ids of a few packed documents per row, positions restarting in each."""
    seg = np.sort(rng.integers(0, 4, size=(batch, seq)), axis=1)
    pos = np.zeros((batch, seq), np.int32)
    for t in range(1, seq):
        pos[:, t] = np.where(seg[:, t] == seg[:, t - 1], pos[:, t - 1] + 1, 0)
    return jnp.asarray(pos), jnp.asarray(seg, jnp.int32)


def problem(*, batch=2, seq=32, heads=4, kv_heads=2, dim=8, segments=False, **mask_fields):
    rng = np.random.default_rng(0)
    draw = lambda *shape: jnp.asarray(rng.normal(size=shape), jnp.float32)  # noqa: E731
    q = draw(batch, seq, heads, dim)
    k, v = draw(batch, seq, kv_heads, dim), draw(batch, seq, kv_heads, dim)
    pos, seg = jnp.tile(jnp.arange(seq), (batch, 1)), None
    if segments:
        pos, seg = packed(rng, batch, seq)
    mask = AttentionMask(pos, pos, seg, seg, **mask_fields)
    return (q, k, v), mask, draw(batch, seq, heads, dim)


CASES = {
    "ring-zigzag-causal": (SEQ8, dict(strategy="ring"), dict()),
    "ring-contiguous-window-segments": (
        SEQ8, dict(strategy="ring", load_balance=False), dict(segments=True, sliding_window=5)
    ),
    "ring-zigzag-window-segments-softcap": (
        SEQ8, dict(strategy="ring"), dict(segments=True, sliding_window=5, logit_softcap=2.0)
    ),
    "ring-bidirectional-data2-seq4": ((2, 1, 1, 4, 1), dict(strategy="ring"), dict(causal=False)),
    "all_to_all-window-segments-gqa": (
        SEQ8, dict(strategy="all_to_all"), dict(heads=8, segments=True, sliding_window=5)
    ),
    "usp-zigzag-window-segments-gqa": (
        SEQ8, dict(strategy="usp", heads_ways=4), dict(heads=8, segments=True, sliding_window=5)
    ),
    "all_gather-fsdp2-seq2-model2": ((1, 2, 1, 2, 2), dict(strategy="all_gather"), dict()),
}  # fmt: skip


@pytest.mark.parametrize("case", CASES)
def test_strategy_equals_the_unsharded_reference_forward_and_backward(case):
    mesh_shape, slot, shape = CASES[case]
    (q, k, v), mask, weights = problem(**shape)
    layer = ContextParallelAttention.default_config().set(**slot).instantiate(parent=None)
    scale = 1 / np.sqrt(q.shape[-1])

    def sharded(q, k, v):
        with sharding_scope(mesh_of(mesh_shape)):
            out, _ = functional(
                layer, prng_key=None, state={}, inputs=(q, k, v, mask), is_training=False
            )
        return jnp.sum(out * weights), out

    def reference(q, k, v):
        allowed = mask.dense()
        cap = mask.logit_softcap
        out = reference_attention(q, k, v, allowed, scale=scale, logit_softcap=cap)
        return jnp.sum(out * weights), out

    grad = lambda f: jax.value_and_grad(f, argnums=(0, 1, 2), has_aux=True)  # noqa: E731
    (_, got), got_grads = jax.jit(grad(sharded))(q, k, v)
    (_, want), want_grads = jax.jit(grad(reference))(q, k, v)
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)
    for g, w in zip(got_grads, want_grads, strict=True):
        np.testing.assert_allclose(g, w, atol=1e-5, rtol=1e-5)


@dataclasses.dataclass
class CountingKernel:
    """The blockwise kernel, recording each forward block's query-key pairs per device."""

    counts: np.ndarray

    def forward_lse(self, q, k, v, mask, *, scale):
        def add(device, pairs):
            self.counts[int(device)] += int(pairs)

        jax.debug.callback(add, jax.lax.axis_index("seq"), q.shape[1] * k.shape[1])
        return BlockwiseKernel().forward_lse(q, k, v, mask, scale=scale)


@pytest.mark.parametrize("skip", [Skip.ZIGZAG, Skip.CONTIGUOUS])
def test_ring_work_per_device_is_balanced_in_zigzag_order(skip):
    """The blocks each device runs, counted as they run: in zigzag order every device attends
    to as many query-key pairs (within 5%), in the mesh's order the last does 8 times the
    first's; `ring_work` (what `axplug aot` reports) predicts both."""
    (q, k, v), mask, _ = problem(batch=1, seq=32, heads=2, kv_heads=2)
    kernel = CountingKernel(np.zeros(8, np.int64))
    spec = PartitionSpec(None, "seq")

    def per_device(q, k, v, mask):
        return ring_attention(
            q, k, v, mask, scale=0.3, axis="seq", ways=8, kernel=kernel, skip=skip
        )

    run = jax.shard_map(per_device, mesh=mesh_of(SEQ8), in_specs=(spec, spec, spec, spec),
                        out_specs=spec, check_vma=False)  # fmt: skip
    jax.block_until_ready(jax.jit(run)(q, k, v, mask))
    chunk = 32 // 16  # tokens per chunk of 2 * ways
    np.testing.assert_array_equal(kernel.counts, ring_work(8, skip) * chunk * chunk)
    balance = kernel.counts.max() / kernel.counts.min()
    assert balance <= 1.05 if skip is Skip.ZIGZAG else balance == 8


def test_blockwise_kernel_is_the_ring_blocks_fallback():
    (q, k, v), mask, _ = problem()
    name, kernel = select_kernel(q, k, v, mask, lse=True)
    assert kernel.supports_lse and name == "blockwise"
    assert select_kernel(q, k, v, mask, lse=True, names=["xla"])[0] == "blockwise"


def test_modifier_swaps_every_kernel_slot_and_keeps_its_scale():
    cfg = Attention.default_config().set(input_dim=16, num_heads=2)
    cfg.kernel = FlashAttention.default_config().set(scale=0.5, kernels=["xla"])
    modify = load("modifiers", "context_parallel")
    out = modify.default_config().set(strategy="all_to_all").instantiate()(cfg)
    assert out.kernel.klass is ContextParallelAttention
    kernel = out.kernel
    assert (kernel.strategy, kernel.scale, kernel.kernels) == ("all_to_all", 0.5, ["xla"])
    again = modify.default_config().instantiate()(out)  # re-applied: the new options win
    assert again.kernel.strategy == "ring"
    with pytest.raises(ConfigError, match="strategy 'rings' is not one of ring, all_to_all"):
        modify.default_config().set(strategy="rings").instantiate()(cfg)


def call(layer, inputs):
    return functional(layer, prng_key=None, state={}, inputs=inputs, is_training=False)[0]


def test_shapes_the_devices_cannot_split_are_one_clear_error():
    with sharding_scope(mesh_of(SEQ8)):
        (q, k, v), mask, _ = problem(seq=24)
        ring = ContextParallelAttention.default_config().instantiate(parent=None)
        with pytest.raises(ConfigError, match="24 tokens cannot be cut into the 16 chunks"):
            jax.eval_shape(lambda *a: call(ring, a), q, k, v, mask)
        (q, k, v), mask, _ = problem(heads=4)
        heads = ContextParallelAttention.default_config().set(strategy="all_to_all")
        layer = heads.instantiate(parent=None)
        with pytest.raises(
            ConfigError, match="splits the 4 query heads a device holds over 8 devices"
        ):
            jax.eval_shape(lambda *a: call(layer, a), q, k, v, mask)


def test_a_ring_train_step_equals_the_gathered_one():
    """llama-tiny (RoPE, the decoder's positions, GSPMD around the shard_map) trained 2 steps
    over `mesh:seq=8`: the ring's losses equal those of the core's gathered keys."""
    from axplug_testing import tiny_trainer_config, train_steps

    from axplug.api.run import Trainer

    losses = {}
    for name, extra in (("gathered", []), ("ring", ["context_parallel:strategy=ring"])):
        cfg = tiny_trainer_config(
            "/nonexistent", "input.batch_size=2", preset="llama-tiny",
            modifiers=["mesh:seq=8", *extra],
        )  # fmt: skip
        assert bool(find_configs(cfg, ContextParallelAttention)) == bool(extra)
        _, metrics = train_steps(Trainer(cfg), 2)
        losses[name] = [float(m["loss"]) for m in metrics]
    np.testing.assert_allclose(losses["ring"], losses["gathered"], rtol=1e-5)
