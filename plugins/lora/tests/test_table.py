"""Adapter tables: many LoRA adapters over one base in one batch, each row its own, against
a numpy reference and against engines over the merged models."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from axplug_lora import AdapterTable, lora_weights
from axplug_lora.table import linears_of, with_table, write_slot
from axplug_testing import tiny_trainer_config

from axplug.api.config import ConfigError
from axplug.api.layers import fold_layers, functional, side_inputs
from axplug.api.run import Engine, Request, SamplingParams
from axplug.api.sharding import DEFAULT_AXIS_RULES, MeshBuilder

PAGED = "paged_kv_cache:page_size=16"
# Two adapters of different ranks on different Linears.
LORAS = ("lora:rank=4,alpha=8,targets=['q','v']", "lora:rank=8,alpha=4")


def _config(*modifiers):
    """The model config of one-layer llama-tiny with `modifiers`."""
    cfg = tiny_trainer_config("/tmp/unused", "model.decoder.transformer.num_layers=1",
                              preset="llama-tiny", modifiers=[PAGED, *modifiers])  # fmt: skip
    return cfg.model


def _random_params(cfg, seed=0):
    """Random parameters of `cfg`'s model, made with numpy (no program compiles for them):
    norm scales 1, weights normal over the square root of their input width, LoRA's `lora_b`
    random too (0.3 x normal), so each adapter changes the model."""
    specs = cfg.instantiate(parent=None, _path="model").create_parameter_specs_recursively()
    rng = np.random.default_rng(seed)

    def init(path, spec):
        if len(spec.shape) == 1:
            return np.ones(spec.shape, np.float32)
        scale = 0.3 if jax.tree_util.keystr(path).endswith("['lora_b']") else spec.shape[0] ** -0.5
        return (scale * rng.standard_normal(spec.shape)).astype(np.float32)

    return jax.tree_util.tree_map_with_path(init, specs, is_leaf=lambda x: hasattr(x, "shape"))


def _within(tree, cfg):
    """`tree` cut to the parameters of `cfg`'s model: its leaves sliced to their shapes (an
    adapter of a lower rank takes the first columns or rows of a higher rank's)."""
    specs = cfg.instantiate(parent=None, _path="model").create_parameter_specs_recursively()

    def visit(spec, value):
        if isinstance(spec, dict):
            return {k: visit(v, value[k]) for k, v in spec.items()}
        return value[tuple(slice(0, n) for n in spec.shape)]

    return visit(specs, tree)


def test_a_table_row_adds_its_own_adapter_and_nothing_without_the_side_input():
    cfg = AdapterTable.default_config().set(name="t", input_dim=6, output_dim=5, slots=3, rank=2)
    layer = cfg.instantiate(parent=None)
    rng = np.random.default_rng(0)
    params = {"lora_a": rng.normal(size=(4, 6, 2)).astype(np.float32),
              "lora_b": rng.normal(size=(4, 2, 5)).astype(np.float32)}  # fmt: skip
    params["lora_a"][0] = params["lora_b"][0] = 0  # entry 0: no adapter
    x, rows = rng.normal(size=(4, 3, 6)).astype(np.float32), np.array([2, 0, 3, 2], np.int32)

    def call(x):
        return functional(layer, prng_key=None, state=params, inputs=(x,), is_training=False)[0]

    with side_inputs(adapter=jnp.asarray(rows)):
        got = np.asarray(jax.jit(call)(x))
    want = np.stack([x[i] @ params["lora_a"][r] @ params["lora_b"][r] for i, r in enumerate(rows)])
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    assert not np.asarray(call(x)).any()  # no side input: every row on the base
    with side_inputs(adapter=jnp.asarray(rows[:2])), pytest.raises(ValueError, match="2 rows"):
        call(x)


@pytest.fixture(scope="module")
def served():
    """(table model, its parameters with the two adapters in slots 1 and 2, the table leaves,
    the base and the adapters' (config, parameters), an engine of 9 rows over the table
    model). One random tree, the second adapter's (rank 8 on every Linear), gives the base
    (without adapters) and the first adapter (rank 4 on q and v: the first 4 ranks of those)."""
    configs = [_config(spec) for spec in LORAS]
    wide = _random_params(configs[1])
    loras = [(cfg, jax.device_put(_within(wide, cfg))) for cfg in configs]
    base_cfg = _config()
    base = jax.device_put(_within(wide, base_cfg))
    weights = [lora_weights(cfg, params) for cfg, params in loras]
    mesh_builder = MeshBuilder.default_config().set(mesh_shape=(1,), axis_names=("fsdp",))
    mesh = mesh_builder.instantiate().build(jax.devices()[:1])
    cfg, params, leaves = with_table(base_cfg, base, linears_of(weights), slots=3, rank=8,
                                     mesh=mesh, axis_rules=DEFAULT_AXIS_RULES)  # fmt: skip
    for slot, adapter in enumerate(weights, start=1):
        params = write_slot(params, leaves, slot, adapter)
    model = cfg.instantiate(parent=None, _path="model")
    # Every test's engine: one set of programs for the module (9 rows, one batch of PROMPTS).
    engine = Engine(model, params, num_slots=9, max_len=64, adapter_slots=3)
    return model, params, leaves, (base_cfg, base), loras, engine


def _greedy(prompt, adapter=0, n=6):
    return Request(prompt, SamplingParams(max_new_tokens=n, temperature=0, logprobs=2),
                   id=(tuple(prompt), adapter), adapter=adapter)  # fmt: skip


PROMPTS = [[5, 6, 7, 8, 9], [10, 11, 12], list(range(40, 60))]


def test_a_mixed_batch_equals_engines_over_the_merged_models(served):
    *_, (base_cfg, base), loras, engine = served
    for prompt in PROMPTS:
        for adapter in (0, 1, 2):
            engine.submit(_greedy(prompt, adapter))
    got = {c.id: c for c in engine.run()}  # every row in one batch
    outputs, compared = set(), 0
    # The merged models have the base's structure: one Engine takes each one's parameters
    # (without a prefix cache: its pages would hold another model's keys).
    reference = Engine(base_cfg.instantiate(parent=None, _path="model"), base, num_slots=3,
                       max_len=64, prefix_caching=False)  # fmt: skip
    for adapter, (cfg, params) in enumerate([(base_cfg, base), *loras]):
        reference.params = fold_layers(cfg, params)[1]
        for prompt in PROMPTS:
            reference.submit(_greedy(prompt))
        for want in reference.run():
            compared += same_until_a_tie(got[(want.id[0], adapter)], want)
            outputs.add(tuple(want.output_ids))
    assert len(outputs) > len(PROMPTS)  # the adapters change what the model says
    assert compared >= 0.8 * 6 * len(PROMPTS) * 3


def same_until_a_tie(mine, want) -> int:
    """Greedy tokens equal and logprobs within 1e-5, up to where `want`'s two best tokens are
    within 1e-4 (float rounding may take either there, and the texts part); the count."""
    for j, (a, b) in enumerate(zip(mine.output_logprobs, want.output_logprobs, strict=True)):
        np.testing.assert_allclose(a.logprob, b.logprob, atol=1e-5)
        if a.token != b.token:
            (_, best), (_, second) = b.top[:2]
            assert best - second < 1e-4, (j, mine.output_ids, want.output_ids)
            return j
    return len(want.output_logprobs)


def test_cached_prefixes_are_shared_within_an_adapter_only(served):
    engine = served[-1]
    # Pages for nine requests: the ones cached stay while the next request runs. No page of
    # PROMPTS' (the other test's, on this engine) starts this prompt: its hits are its own.
    prompt = list(range(60, 95))  # two full pages
    first = {}
    for adapter in (1, 2, 1, 0):
        hits = engine.prefix_hit_tokens
        engine.submit(_greedy(prompt, adapter, 2))
        (done,) = engine.run()
        first.setdefault(adapter, done.output_ids)
        assert done.output_ids == first[adapter]
        shared = engine.prefix_hit_tokens - hits
        assert shared == (32 if adapter == 1 and len(first) == 2 else 0), adapter


def test_slots_refuse_what_they_cannot_hold(served):
    _, params, leaves, _, loras, engine = served
    # The rank-8 adapter zero-padded to rank 16.
    rank16 = _config("lora:rank=16,alpha=8")
    wider = {"lora_a": ((0, 0), (0, 8)), "lora_b": ((0, 8), (0, 0))}
    padded = jax.tree_util.tree_map_with_path(
        lambda path, x: np.pad(x, wider[path[-1].key]) if path[-1].key in wider else x,
        jax.device_get(loras[1][1]),
    )
    with pytest.raises(ConfigError, match="rank 16 exceeds the tables' 8"):
        write_slot(params, leaves, 1, lora_weights(rank16, padded))
    attention_only = {k for k in leaves if ".attention." in k}
    with pytest.raises(ConfigError, match="feed_forward.* which no adapter table holds"):
        write_slot(params, attention_only, 1, lora_weights(*loras[1]))
    with pytest.raises(ValueError, match="adapter 4 is not one of this engine's 3 adapter slots"):
        engine.submit(_greedy([1, 2], 4))
