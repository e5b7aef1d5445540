"""Weight-only int8 / fp8 for serving: the quantization against numpy, the layer against a
float64 product, and a trained model's logits, bytes and greedy tokens against its float self."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from axplug_quantize import WeightOnlyLinear, quantize_weights
from axplug_quantize.weights import quantized_weight

from axplug.api.config import ConfigError, find_configs
from axplug.api.layers import functional
from axplug.api.run import Engine, Request, SamplingParams, load_checkpoint

NUMPY = {"int8": (np.int8, 127.0), "fp8": (ml_dtypes.float8_e4m3fn, 448.0)}


@pytest.mark.parametrize("fmt", ["int8", "fp8"])
def test_weights_quantize_per_output_channel_as_numpy_does(fmt):
    rng = np.random.default_rng(0)
    w = (rng.normal(size=(3, 24, 10)) * rng.uniform(0.1, 3, size=(3, 1, 10))).astype(np.float32)
    w[1, :, 4] = 0  # a dead channel: scale 1, zeros
    q, scale = (np.asarray(a) for a in quantized_weight(jnp.asarray(w), fmt))
    dtype, top = NUMPY[fmt]
    want_scale = np.abs(w).max(axis=-2) * np.float32(1 / top)
    want_scale[want_scale == 0] = 1
    np.testing.assert_array_equal(scale, want_scale)
    ratio = w / want_scale[..., None, :]
    want = np.round(ratio).astype(dtype) if fmt == "int8" else ratio.astype(dtype)
    assert q.dtype == want.dtype
    np.testing.assert_array_equal(q.astype(np.float32), want.astype(np.float32))
    assert np.abs(q.astype(np.float32)).max() == top  # each channel's largest at the top


@pytest.mark.parametrize("fmt", ["int8", "fp8"])
def test_the_layer_multiplies_the_stored_weight_and_scale(fmt):
    cfg = WeightOnlyLinear.default_config().set(name="w", input_dim=16, output_dim=8, bias=True,
                                                format=fmt)  # fmt: skip
    layer = cfg.instantiate(parent=None)
    rng = np.random.default_rng(1)
    q, scale = quantized_weight(jnp.asarray(rng.normal(size=(16, 8)), jnp.float32), fmt)
    params = {"weight": q, "scale": scale, "bias": jnp.asarray(rng.normal(size=8), jnp.float32)}
    x = rng.normal(size=(2, 5, 16)).astype(np.float32)
    got = functional(layer, prng_key=None, state=params, inputs=(x,), is_training=False)[0]
    want = x.astype(np.float64) @ (np.asarray(q, np.float64) * np.asarray(scale, np.float64))
    np.testing.assert_allclose(got, want + np.asarray(params["bias"]), rtol=1e-5, atol=1e-5)
    with pytest.raises(ConfigError, match="unknown format 'int4'"):
        cfg.clone(format="int4").instantiate(parent=None)


@pytest.fixture(scope="module")
def trained(trained_run):
    """llama-tiny trained once per session (shared: read only), loaded."""
    return load_checkpoint(trained_run("llama-tiny", "input.seq_len=64"))


# Measured on the session's tiny llama (2 training steps, logits' std ~1): int8 ~0.05, fp8 ~0.3.
LOGIT_TOLERANCE = {"int8": 0.15, "fp8": 0.6}


@pytest.mark.parametrize("fmt", ["int8", "fp8"])
def test_a_quantized_model_is_a_quarter_of_the_bytes_and_near_its_logits(trained, fmt):
    cfg, params = quantize_weights(trained.config.model, trained.params, fmt, mesh=trained.mesh,
                                   axis_rules=trained.axis_rules)  # fmt: skip
    linears = find_configs(cfg, WeightOnlyLinear)
    assert linears and all(".attention." in p or ".feed_forward." in p for p, _ in linears)
    before, after = (sum(a.nbytes for a in jax.tree.leaves(p)) for p in (trained.params, params))
    weights = [a for path, a in jax.tree_util.tree_leaves_with_path(params)
               if a.dtype == NUMPY[fmt][0]]  # fmt: skip
    stored = sum(a.size for a in weights)
    scales = sum(a.size // a.shape[-2] for a in weights)
    assert before - after == 3 * stored - 4 * scales  # 4 bytes to 1, plus a scale per channel
    quantized = trained.with_model(cfg, params)
    ids = np.random.default_rng(2).integers(0, trained.vocab_size, (4, 24))
    want, got = trained.logits(ids), quantized.logits(ids)
    error = np.abs(got - want).max()
    print(
        f"{fmt}: max |logit error| {error:.4f} (logits' std {want.std():.3f}); parameters "
        f"{before} -> {after} bytes ({after / before:.3f}x)"
    )
    assert 0 < error < LOGIT_TOLERANCE[fmt]
    # Where the float model's top two differ by more than twice a position's error, the tops
    # agree (the error cannot swap them); elsewhere they may differ.
    top2 = np.sort(want, axis=-1)[..., -2:]
    sure = top2[..., 1] - top2[..., 0] > 2 * np.abs(got - want).max(axis=-1)
    assert sure.any()
    np.testing.assert_array_equal(got.argmax(-1)[sure], want.argmax(-1)[sure])


def test_greedy_tokens_of_the_int8_model_on_a_prompt_set(trained):
    cfg, params = quantize_weights(trained.config.model, trained.params, "int8",
                                   mesh=trained.mesh, axis_rules=trained.axis_rules)  # fmt: skip
    prompts = np.random.default_rng(3).integers(0, trained.vocab_size, (8, 12)).tolist()
    outputs = []
    for model, weights in ((trained.model, trained.params),
                           (cfg.instantiate(parent=None, _path="model"), params)):  # fmt: skip
        engine = Engine(model, weights, num_slots=8, max_len=32)
        for i, prompt in enumerate(prompts):
            engine.submit(Request(prompt, SamplingParams(max_new_tokens=8, temperature=0), id=i))
        outputs.append({c.id: c.output_ids for c in engine.run()})
    float_ids, int8_ids = outputs
    agree = [sum(a == b for a, b in zip(float_ids[i], int8_ids[i], strict=True)) / 8
             for i in range(len(prompts))]  # fmt: skip
    first = np.mean([float_ids[i][0] == int8_ids[i][0] for i in range(len(prompts))])
    print(f"int8 greedy tokens equal to float's: {np.mean(agree):.3f} (first tokens {first})")
    assert first >= 7 / 8 and np.mean(agree) >= 0.5
