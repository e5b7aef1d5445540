"""Quantized training (int8, fp8): rounding bounds, integer dots, fp8 histories, the modifier."""

import functools
import re

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from axplug_quantize import QuantizedLinear, fp8_matmul, int8_matmul
from axplug_testing import tiny_trainer_config

from axplug.api.config import ConfigError, find_configs
from axplug.api.layers import Linear
from axplug.api.summary import read_jsonl


def operands():
    x = np.asarray(jax.random.normal(jax.random.PRNGKey(0), (24, 48)), np.float64)
    w = np.asarray(jax.random.normal(jax.random.PRNGKey(1), (48, 16)), np.float64) * 0.3
    return x, w


def int8_bound(a, b):
    """|a @ b - int8(a) @ int8(b)| bound: a per-row scale for a, per-column for b."""
    sa = np.abs(a).max(axis=1, keepdims=True) / 127
    sb = np.abs(b).max(axis=0, keepdims=True) / 127
    rows, cols = np.abs(a).sum(axis=1, keepdims=True), np.abs(b).sum(axis=0, keepdims=True)
    return sa / 2 * cols + rows * sb / 2 + a.shape[1] * sa * sb / 4


# The matmuls compiled as one program each (op by op, every op would compile for its shape).
int8_forward = jax.jit(int8_matmul, static_argnums=2)


@functools.partial(jax.jit, static_argnums=3)
def int8_vjp(x, w, dy, int8_backward):
    """(dx, dw) of int8_matmul(x, w) for the output cotangent dy."""
    _, vjp = jax.vjp(lambda a, b: int8_matmul(a, b, int8_backward), x, w)
    return vjp(dy)


@jax.jit
def fp8_vjp(x, w, hx, hw, hdy, dy):
    """fp8_matmul's output and the cotangents of its five arguments for dy."""
    y, vjp = jax.vjp(fp8_matmul, x, w, hx, hw, hdy)
    return y, vjp(dy)


def test_int8_forward_is_within_the_rounding_bound():
    x, w = operands()
    y = np.asarray(int8_forward(jnp.float32(x), jnp.float32(w), True), np.float64)
    err = np.abs(y - x @ w)
    assert np.all(err <= int8_bound(x, w) * 1.001 + 1e-5)
    assert err.max() > 0  # really quantized


@pytest.mark.parametrize("int8_backward", [True, False])
def test_int8_gradients(int8_backward):
    x, w = operands()
    dy = np.asarray(jax.random.normal(jax.random.PRNGKey(2), (24, 16)), np.float64)
    grads = int8_vjp(jnp.float32(x), jnp.float32(w), jnp.float32(dy), int8_backward)
    dx, dw = (np.asarray(g, np.float64) for g in grads)
    if not int8_backward:  # straight-through: the float gradients of x @ w
        np.testing.assert_allclose(dx, dy @ w.T, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(dw, x.T @ dy, rtol=1e-5, atol=1e-5)
        return
    assert np.all(np.abs(dx - dy @ w.T) <= int8_bound(dy, w.T) * 1.001 + 1e-5)
    assert np.all(np.abs(dw - x.T @ dy) <= int8_bound(x.T, dy) * 1.001 + 1e-5)


def test_fp8_matmul_matches_an_e4m3_e5m2_reference():
    x, w = operands()
    dy = np.asarray(jax.random.normal(jax.random.PRNGKey(2), (24, 16)), np.float64)
    hx, hw, hdy = np.zeros(8), np.zeros(8), np.zeros(8)
    hx[3], hw[5], hdy[1] = 2 * np.abs(x).max(), np.abs(w).max(), 4 * np.abs(dy).max()

    def qdq(a, history, dtype):
        fmax = float(ml_dtypes.finfo(dtype).max)
        scale = history.max() / fmax
        return np.clip(a / scale, -fmax, fmax).astype(dtype).astype(np.float64) * scale

    e4m3, e5m2 = ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e5m2
    xq, wq, dyq = qdq(x, hx, e4m3), qdq(w, hw, e4m3), qdq(dy, hdy, e5m2)
    y, (dx, dw, dhx, dhw, new_hdy) = fp8_vjp(*(jnp.float32(a) for a in (x, w, hx, hw, hdy, dy)))
    np.testing.assert_allclose(y, xq @ wq, rtol=1e-5, atol=1e-5)
    assert np.abs(np.asarray(y) - x @ w).max() > 1e-3  # really quantized
    np.testing.assert_allclose(dx, dyq @ wq.T, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(dw, xq.T @ dyq, rtol=1e-5, atol=1e-5)
    assert not np.any(dhx) and not np.any(dhw)
    # The gradient history comes back rolled by one with this step's amax in front.
    np.testing.assert_allclose(new_hdy, np.concatenate([[np.abs(dy).max()], hdy[:-1]]), rtol=1e-6)


def _dots(hlo: str) -> list[tuple[str, str, str]]:
    """(result, lhs, rhs) element types of every dot in compiled HLO text."""
    found = []
    for computation in hlo.split("\n\n"):
        types = dict(re.findall(r"%([\w.\-]+) = (\w+)\[", computation))
        for result, lhs, rhs in re.findall(
            r"= (\w+)\[[^\]]*\]\S* dot\(%([\w.\-]+), %([\w.\-]+)\)", computation
        ):
            found.append((result, types.get(lhs), types.get(rhs)))
    return found


def tiny(tmp_path, *modifiers, steps=3, extra=()):
    from axplug.api.summary import JsonlWriter

    return tiny_trainer_config(
        tmp_path,
        "checkpoint_every=3",
        "log_every=1",
        "input.seq_len=64",
        "mesh.mesh_shape=(1, 1, 1, 1, 1)",
        *extra,
        preset="llama-tiny",
        modifiers=modifiers,
        max_steps=steps,
        summary_writers=[JsonlWriter.default_config()],
    )


def test_int8_train_step_compiles_to_integer_dots(tmp_path):
    trainer = tiny(tmp_path, "quantize:int8").instantiate(devices=jax.devices()[:1])
    token = jax.ShapeDtypeStruct((8, 64), jnp.int32, sharding=trainer.batch_sharding)
    hlo = (
        trainer._train_step.lower(
            trainer.layout.abstract, {"input_ids": token, "target_labels": token}
        )
        .compile()
        .as_text()
    )
    dots = _dots(hlo)
    integer = [d for d in dots if d == ("s32", "s8", "s8")]
    # int8 x int8 dots of the quantized matmuls' forward and backward: 7 in each layer.
    layers = trainer.config.model.decoder.transformer.num_layers
    assert len(integer) >= 7 * layers, dots
    paths = [p for p, _ in find_configs(trainer.config, QuantizedLinear)]
    assert all(".attention." in p or ".feed_forward." in p for p in paths) and len(paths) == 3


def final_loss(path, *modifiers):
    """The last logged loss of 100 steps of llama-tiny (sequences of 64) on one device."""
    cfg = tiny(path, *modifiers, steps=100, extra=["checkpoint_every=1000"])
    cfg.instantiate(devices=jax.devices()[:1]).run()
    return [r["loss"] for r in read_jsonl(path / "metrics.jsonl") if "loss" in r][-1]


@pytest.fixture(scope="module")
def float32_loss(tmp_path_factory):
    return final_loss(tmp_path_factory.mktemp("float32"))


@pytest.mark.slow
@pytest.mark.parametrize(
    "mode, within",
    [("int8", 0.03), ("fp8", 0.03), ("fp8_tensorwise", 0.01), ("fp8_rowwise", 0.01),
     ("mxfp8", 0.01)],
)  # fmt: skip
def test_quantized_training_tracks_float32(tmp_path, float32_loss, mode, within):
    """100 steps of llama-tiny: the final loss within 3% of the float32 run's (1% for the
    current-scaling recipes)."""
    quantized = final_loss(tmp_path, f"quantize:{mode}")
    assert abs(quantized - float32_loss) / float32_loss < within, (quantized, float32_loss)
    assert float32_loss < 3.0  # it learned


def test_fp8_histories_advance_and_survive_a_restart(tmp_path):
    cfg = tiny(tmp_path, "quantize:fp8", "scan_layers", steps=3)
    trainer = cfg.instantiate(devices=jax.devices()[:1])
    trainer.run()
    wo = trainer.state["params"]["decoder"]["transformer"]["layer"]["feed_forward"]["wo"]
    for name in ("x_amax_history", "w_amax_history", "dy_amax_history"):
        history = np.asarray(wo[name])  # [layers, history]
        assert history.shape == (cfg.model.decoder.transformer.num_layers, 16)
        assert np.all(history[:, :3] > 0) and not np.any(history[:, 3:]), (name, history)
    # The weight amax is the previous step's max |w| (the history's front).
    w = np.asarray(
        trainer.state["params"]["decoder"]["transformer"]["layer"]["feed_forward"]["wo"]["weight"]
    )
    assert np.all(np.asarray(wo["w_amax_history"])[:, 0] <= np.abs(w).max(axis=(1, 2)) * 1.05)
    # Restored from the checkpoint and carried on: steps 4-5 of a resumed run.
    resumed = tiny(tmp_path, "quantize:fp8", "scan_layers", steps=5).instantiate(
        devices=jax.devices()[:1]
    )
    resumed.run()
    again = resumed.state["params"]["decoder"]["transformer"]["layer"]["feed_forward"]["wo"]
    np.testing.assert_array_equal(
        np.asarray(again["x_amax_history"])[:, 2:5], np.asarray(wo["x_amax_history"])[:, 0:3]
    )
    assert np.all(np.asarray(again["x_amax_history"])[:, :5] > 0)


def test_quantize_modifier_specs(tmp_path):
    cfg = tiny(tmp_path, "quantize:int8", "quantize:none")
    assert not find_configs(cfg, QuantizedLinear) and find_configs(cfg, Linear)
    cfg = tiny(tmp_path, "quantize:mode=fp8,targets=['feed_forward']")
    paths = [p for p, _ in find_configs(cfg, QuantizedLinear)]
    assert paths == ["model.decoder.transformer.layer.feed_forward.linear"]
    with pytest.raises(ConfigError, match="unknown mode 'int4'"):
        tiny(tmp_path, "quantize:int4")
    with pytest.raises(ConfigError, match="fp8 amax histories are not kept per microbatch"):
        tiny(tmp_path, "pipeline:stages=2,microbatches=2", "quantize:fp8")
