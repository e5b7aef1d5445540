"""The axplug-moe plugin: routing, capacity, aux losses, every dispatch, the `moe` modifier,
presets, training, and expert parallelism on 8 fake CPU devices.

References are written here: a float64 numpy MoE (softmax, top-k, renormalization, k-major
capacity priority, drops, gated experts, both aux losses, routing statistics) and a plain-jnp
dense one (every expert on every token, masked) for gradients; neither calls the plugin's
helpers.

Tolerance policy (as in tests/test_layers.py): float32 layer outputs against float64 numpy
rtol = atol = 1e-5; gradients and whole models 1e-4; bfloat16 compute 3e-2 of the output
scale against the float64 reference. Runs on different meshes reduce in different orders:
losses agree to rtol 1e-4 over 6 steps (a routing choice flipped by rounding would show as
~1e-2), parameters to rtol 1e-3 / atol 5e-4 (5% of one Adam step at learning rate 1e-2: Adam
turns rounding differences of near-zero gradients into visible updates). Structural checks
are exact.
"""

from __future__ import annotations

import functools
import json
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from axplug.api import registry

axplug_moe = pytest.importorskip("axplug_moe")
if not any(c.distribution == "axplug-moe" and c.loadable for c in registry.discover()):
    pytest.skip("axplug-moe is disabled", allow_module_level=True)

from axplug_moe import (  # noqa: E402
    DISPATCHERS,
    AutoDispatch,
    MoEFeedForward,
    MoELayerGroup,
    expert_capacity,
)
from axplug_testing import cli_main as main  # noqa: E402
from axplug_testing import tiny_train_args, tiny_trainer_config, train_steps  # noqa: E402

from axplug.api.config import (  # noqa: E402
    ConfigError,
    find_configs,
    make_modifier,  # noqa: E402
    preset_config,  # noqa: E402
)
from axplug.api.layers import (
    FeedForward,
    RepeatedTransformer,
    StackedTransformer,
    TransformerLayer,
    functional,
)

F32 = dict(rtol=1e-5, atol=1e-5)
F32_LOOSE = dict(rtol=1e-4, atol=1e-4)
G, S, D, F, E = 2, 8, 16, 24, 4  # groups (sequences), group size, dim, hidden, experts
DIST = "axplug-moe"


def normal(i: int, shape, scale: float = 1.0) -> np.ndarray:
    return (scale * np.random.default_rng(i).standard_normal(shape)).astype(np.float32)


def assert_close(actual, desired, tol=F32):
    np.testing.assert_allclose(
        np.asarray(actual, np.float64), np.asarray(desired, np.float64), **tol
    )


# ------------------------------------------------------------------------- distribution

EXPECTED = {
    ("layers", "moe_feed_forward"),
    ("layers", "top_k_router"),
    ("layers", "deepseek_router"),
    ("layers", "moe_layer_group"),
    ("layers", "moe_dense_first_stack"),
    ("layers", "moe_repeated_dense_first_stack"),
    ("layers", "moe_auto_dispatch"),
    ("layers", "moe_einsum_dispatch"),
    ("layers", "moe_gather_dispatch"),
    ("layers", "moe_ragged_dispatch"),
    ("layers", "moe_balanced_dispatch"),
    ("layers", "moe_alltoall_dispatch"),
    ("modifiers", "moe"),
    ("presets", "moe-tiny"),
    ("presets", "mixtral-8x7b"),
    ("presets", "moe-fine-tiny"),
    ("presets", "mixtral-tiny"),
    ("presets", "qwen3-30b-a3b"),
    ("presets", "deepseek-v3-671b"),
    ("architectures", "MixtralForCausalLM"),
    ("architectures", "Qwen2MoeForCausalLM"),
    ("architectures", "Qwen3MoeForCausalLM"),
    ("architectures", "DeepseekV3ForCausalLM"),
}


def test_list_json_shows_this_distribution_components(capsys):
    assert main(["list", "--check", "--json"]) == 0
    rows = [r for r in json.loads(capsys.readouterr().out) if r["distribution"] == DIST]
    assert {(r["kind"], r["name"]) for r in rows} == EXPECTED
    assert all(r["status"] == "ok" and r["version"] == "0.1.0" for r in rows), rows


def test_core_alone_fails_with_the_install_hint(tmp_path, monkeypatch):
    # Hide this distribution's metadata, as if only the core (and attention) were installed; a
    # third party's preset that names this plugin's `moe` modifier gets the install hint.
    import importlib_metadata
    from axplug_testing import run_cli

    recipe = tmp_path / "recipe.py"
    recipe.write_text(
        "from axplug.presets import Preset, resolve_preset\n"
        "def mixtral():\n"
        "    return Preset('mixtral-8x7b', 'Mixtral shapes', resolve_preset('llama2-7b').build,\n"
        f"                  ('moe:num_experts=8,top_k=2',), {{'moe': {DIST!r}}})\n"
    )
    everything = importlib_metadata.distributions
    with monkeypatch.context() as patch:
        patch.setattr(
            importlib_metadata,
            "distributions",
            lambda **kw: [d for d in everything(**kw) if d.name != DIST],
        )
        for name in ("AXPLUG_DISABLE_PLUGINS", "AXPLUG_LOAD_PLUGINS"):
            patch.delenv(name, raising=False)
        registry.reset()  # discovered again without this distribution
        try:
            result = run_cli("train", "--preset", f"{recipe}:mixtral", "--print-config",
                             "--output-dir", str(tmp_path))  # fmt: skip
        finally:
            registry.reset()
    assert result.exit_code == 2, result.stderr
    assert "preset mixtral-8x7b needs modifier 'moe': pip install axplug-moe" in result.stderr
    assert any(c.distribution == DIST for c in registry.discover())  # discovered again


# ------------------------------------------------------------------- numpy reference MoE


def ref_act(name):
    return {
        "silu": lambda v: v / (1.0 + np.exp(-v)),
        "relu": lambda v: np.maximum(v, 0.0),
    }[name]


def ref_moe(x, w, *, top_k, capacity_factor, renormalize=True, activation="silu"):
    """Float64 numpy MoE over groups x [g, s, d]; w: router [d, e], wi_up/wi_gate [e, d, h],
    wo [e, h, d] (wi_gate absent: not gated). Returns (y, stats)."""
    x = np.asarray(x, np.float64)
    router = np.asarray(w["router"], np.float64)
    g, s, _ = x.shape
    e = router.shape[1]
    logits = x @ router
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    index = np.argsort(-probs, axis=-1, kind="stable")[..., :top_k]  # [g, s, k]
    gates = np.take_along_axis(probs, index, axis=-1)
    if renormalize:
        gates = gates / gates.sum(-1, keepdims=True)
    cap = s if capacity_factor is None else min(s, math.ceil(capacity_factor * s * top_k / e))
    kept = np.zeros(index.shape, bool)
    for gi in range(g):
        taken = np.zeros(e, int)
        for j in range(top_k):  # every token's first choice, then every second choice...
            for si in range(s):
                ex = index[gi, si, j]
                kept[gi, si, j] = taken[ex] < cap
                taken[ex] += 1
    act = ref_act(activation)
    up = np.asarray(w["wi_up"], np.float64)
    gate_w = None if "wi_gate" not in w else np.asarray(w["wi_gate"], np.float64)
    wo = np.asarray(w["wo"], np.float64)
    y = np.zeros_like(x)
    for gi, si, j in np.ndindex(*index.shape):
        if not kept[gi, si, j]:
            continue
        ex, v = index[gi, si, j], x[gi, si]
        h = act(v @ gate_w[ex]) * (v @ up[ex]) if gate_w is not None else act(v @ up[ex])
        y[gi, si] += gates[gi, si, j] * (h @ wo[ex])
    load = np.bincount(index.reshape(-1), minlength=e) / index.size
    lse = np.log(np.exp(logits).sum(-1))
    stats = dict(
        load_balance=e * np.sum(load * probs.mean((0, 1))),
        z=np.mean(lse**2),
        dropped_fraction=1.0 - kept.mean(),
        expert_load=load,
        capacity=cap,
    )
    return y, stats


def moe_cfg(dispatch="einsum", *, top_k=2, capacity_factor=1.0, experts=E, **kwargs):
    cfg = MoEFeedForward.default_config().set(
        input_dim=D,
        hidden_dim=F,
        num_experts=experts,
        dispatch=DISPATCHERS[dispatch].default_config(),
        **kwargs,
    )
    cfg.router.set(
        top_k=top_k,
        capacity_factor=capacity_factor,
        load_balance_coefficient=0.5,
        z_loss_coefficient=0.25,
    )
    return cfg


def skewed_case(gated=True):
    """Inputs and weights where expert 0 is every token's favourite, so capacity drops."""
    favourite = normal(1, (D,))
    x = normal(2, (G, S, D)) + 0.5 * favourite
    router = normal(3, (D, E), 0.3)
    router[:, 0] += 0.4 * favourite / np.linalg.norm(favourite)
    w = {
        "router": router,
        "wi_up": normal(4, (E, D, F), D**-0.5),
        "wo": normal(5, (E, F, D), F**-0.5),
    }
    if gated:
        w["wi_gate"] = normal(6, (E, D, F), D**-0.5)
    return x, w


def layer_params(w):
    """The layer's parameters from numpy weights, placed with `device_put` (`jnp.asarray` of
    a numpy array compiles a program per shape)."""
    p = {k: jax.device_put(v) for k, v in w.items() if k != "router"}
    return {**p, "router": {"weight": jax.device_put(w["router"])}}


@functools.cache
def _jitted(model):
    def call(params, x):
        return functional(model, prng_key=None, state=params, inputs=(x,), is_training=True)

    return jax.jit(call)


def run(cfg, params, x):
    """(y, collection) of the layer `cfg` under jit."""
    model = cfg.instantiate(parent=None)
    return _jitted(model)(params, jax.device_put(x))


# (top_k, capacity_factor, renormalize, gated, activation): drops, drop-free, and top-1
# with raw probabilities through an ungated relu expert.
CASES = {
    "top2_capacity": (2, 1.0, True, True, "silu"),
    "top2_drop_free": (2, None, True, True, "silu"),
    "top1_raw_ungated": (1, 1.5, False, False, "relu"),
    # Qwen2-MoE's routing: the top-2 softmax probabilities as they are (norm_topk_prob=False).
    "top2_raw_drop_free": (2, None, False, True, "silu"),
}


# `auto` runs `gather` with a capacity and `balanced` drop-free on CPU: one case of each
# branch shows it delegates (the other two cases are those dispatches' own, below).
AUTO_COVERED = {"top1_raw_ungated", "top2_raw_drop_free"}
# Raw probabilities are the router's alone (every dispatch only multiplies by the combine
# weights it is given): one dispatch, `balanced` (what drop-free `auto` runs on CPU), shows
# them reach the output; every dispatch's use of the weights is in the other cases.
ROUTER_ONLY = {"top2_raw_drop_free": "balanced"}


def covered(dispatch, case):
    if dispatch == "auto" and case in AUTO_COVERED:
        return False
    return ROUTER_ONLY.get(case, dispatch) == dispatch


@pytest.mark.parametrize(
    "dispatch, case",
    [
        pytest.param(dispatch, case, id=f"{dispatch}-{case}")
        for case in CASES
        for dispatch in DISPATCHERS
        if covered(dispatch, case)
    ],
)
def test_every_dispatch_matches_the_numpy_reference(dispatch, case):
    top_k, capacity_factor, renormalize, gated, activation = CASES[case]
    x, w = skewed_case(gated=gated)
    cfg = moe_cfg(
        dispatch, top_k=top_k, capacity_factor=capacity_factor, gated=gated, activation=activation
    )
    cfg.router.renormalize = renormalize
    y, collection = run(cfg, layer_params(w), x)
    want, stats = ref_moe(
        x,
        w,
        top_k=top_k,
        capacity_factor=capacity_factor,
        renormalize=renormalize,
        activation=activation,
    )
    assert_close(y, want)
    router_out = collection.module_outputs["router"]
    assert set(router_out) == {"load_balance_loss", "router_z_loss"}
    assert_close(router_out["load_balance_loss"], 0.5 * stats["load_balance"])
    assert_close(router_out["router_z_loss"], 0.25 * stats["z"])
    summaries = collection.summaries["router"]
    assert_close(summaries["moe/dropped_fraction"], stats["dropped_fraction"])
    assert_close(summaries["moe/expert_load"], stats["expert_load"])
    if capacity_factor is None:
        assert stats["dropped_fraction"] == 0.0
    else:
        assert stats["dropped_fraction"] > 0.1  # the capacity path really drops


def dense_ffn_params():
    return {
        "wi_gate": {"weight": normal(10, (D, F), D**-0.5)},
        "wi_up": {"weight": normal(11, (D, F), D**-0.5)},
        "wo": {"weight": normal(12, (F, D), F**-0.5)},
    }


# `auto` is left out where its delegate is a case already: it runs `balanced` drop-free
# (one expert, top-1: capacity = every token) and `gather` with a capacity on CPU, and its
# delegation is shown in test_every_dispatch_matches_the_numpy_reference.
DELEGATES = [d for d in DISPATCHERS if d != "auto"]


@pytest.mark.parametrize("dispatch", DELEGATES)
def test_one_expert_top1_equals_the_dense_ffn(dispatch):
    dense = FeedForward.default_config().set(input_dim=D, hidden_dim=F).instantiate(parent=None)
    dense_params = jax.device_put(dense_ffn_params())
    params = {name: jax.device_put(w["weight"][None]) for name, w in dense_ffn_params().items()}
    params["router"] = {"weight": jax.device_put(normal(13, (D, 1)))}
    x = jax.device_put(normal(7, (G, S, D)))
    want, _ = _jitted(dense)(dense_params, x)
    got, collection = run(moe_cfg(dispatch, top_k=1, experts=1), params, x)
    assert_close(got, want)
    assert_close(collection.summaries["router"]["moe/dropped_fraction"], 0.0)


def jnp_reference(params, x, *, top_k, capacity_factor):
    """Plain-jnp dense MoE: every expert on every token, masked by the routing; gated silu."""
    router = params["router"]["weight"]
    g, s, _ = x.shape
    e = router.shape[1]
    probs = jax.nn.softmax(x @ router, axis=-1)
    gates, index = jax.lax.top_k(probs, top_k)
    gates = gates / gates.sum(-1, keepdims=True)
    cap = s if capacity_factor is None else min(s, math.ceil(capacity_factor * s * top_k / e))
    onehot = jax.nn.one_hot(index, e)  # [g, s, k, e]
    arrivals = jnp.cumsum(onehot.transpose(0, 2, 1, 3).reshape(g, top_k * s, e), axis=1)
    arrivals = arrivals.reshape(g, top_k, s, e).transpose(0, 2, 1, 3)
    kept = jnp.sum(onehot * (arrivals <= cap), axis=-1)  # [g, s, k]
    weight = jnp.einsum("gske,gsk->gse", onehot, gates * kept)  # [g, s, e]
    h = jax.nn.silu(jnp.einsum("gsd,edh->gseh", x, params["wi_gate"]))
    h = h * jnp.einsum("gsd,edh->gseh", x, params["wi_up"])
    return jnp.einsum("gseh,ehd,gse->gsd", h, params["wo"], weight)


PROBE = normal(8, (G, S, D))


@functools.cache
def reference_grads():
    x, w = skewed_case()

    def ref_loss(params, x):
        return jnp.sum(jnp_reference(params, x, top_k=2, capacity_factor=1.0) * PROBE)

    return jax.jit(jax.grad(ref_loss, argnums=(0, 1)))(layer_params(w), jax.device_put(x))


@pytest.mark.parametrize("dispatch", DELEGATES)  # `auto`: `gather` here (capacity 1.0)
def test_gradients_match_a_dense_reference_and_reach_the_router(dispatch):
    x, w = skewed_case()
    cfg = moe_cfg(dispatch, capacity_factor=1.0)
    cfg.router.set(load_balance_coefficient=0.0, z_loss_coefficient=0.0)
    model = cfg.instantiate(parent=None)

    def loss(params, x):
        y, _ = functional(model, prng_key=None, state=params, inputs=(x,), is_training=True)
        return jnp.sum(y * PROBE)

    got = jax.jit(jax.grad(loss, argnums=(0, 1)))(layer_params(w), jax.device_put(x))
    jax.tree.map(lambda a, b: assert_close(a, b, F32_LOOSE), got, reference_grads())
    router_grad = got[0]["router"]["weight"]
    assert np.all(np.isfinite(router_grad)) and float(np.abs(np.asarray(router_grad)).max()) > 1e-3


def test_aux_losses_have_gradients_into_the_router_only():
    x, w = skewed_case()
    model = moe_cfg("gather").instantiate(parent=None)

    def aux(params):
        _, collection = functional(
            model, prng_key=None, state=params, inputs=(jnp.asarray(x),), is_training=True
        )
        out = collection.module_outputs["router"]
        return out["load_balance_loss"] + out["router_z_loss"]

    grads = jax.device_get(jax.jit(jax.grad(aux))(layer_params(w)))  # numpy: no eager op
    assert float(np.abs(grads["router"]["weight"]).max()) > 1e-4
    assert all(float(np.abs(grads[n]).max()) == 0.0 for n in ("wi_gate", "wi_up", "wo"))


def test_shared_expert_adds_a_dense_ffn_on_every_token():
    x, w = skewed_case()
    cfg = moe_cfg("gather", num_shared_experts=2, shared_hidden_dim=F // 2)
    model = cfg.instantiate(parent=None)
    shapes = model.create_parameter_specs_recursively()["shared_expert"]
    assert {k: v["weight"].shape for k, v in shapes.items()} == {
        "wi_gate": (D, F),  # 2 experts x F / 2
        "wi_up": (D, F),
        "wo": (F, D),
    }
    shared = dense_ffn_params()
    y, _ = _jitted(model)({**layer_params(w), "shared_expert": shared}, jax.device_put(x))
    want, _ = ref_moe(x, w, top_k=2, capacity_factor=1.0)
    sw = {k: np.asarray(v["weight"], np.float64) for k, v in shared.items()}
    xs = x.astype(np.float64)
    dense = (ref_act("silu")(xs @ sw["wi_gate"]) * (xs @ sw["wi_up"])) @ sw["wo"]
    assert_close(y, want + dense)


def test_shared_expert_gate_scales_the_shared_expert_by_a_sigmoid_per_token():
    # Qwen2-MoE: y = moe(x) + sigmoid(x @ w_gate) * shared(x), w_gate [dim, 1] without bias.
    x, w = skewed_case()
    cfg = moe_cfg(
        "gather", capacity_factor=None, num_shared_experts=1, shared_hidden_dim=F // 2,
        shared_expert_gate=True,
    )  # fmt: skip
    cfg.router.renormalize = False
    model = cfg.instantiate(parent=None)
    specs = model.create_parameter_specs_recursively()
    assert specs["shared_expert_gate"]["weight"].shape == (D, 1)
    assert "bias" not in specs["shared_expert_gate"]
    assert specs["shared_expert"]["wi_up"]["weight"].shape == (D, F // 2)
    shared = {
        "wi_gate": {"weight": normal(10, (D, F // 2), D**-0.5)},
        "wi_up": {"weight": normal(11, (D, F // 2), D**-0.5)},
        "wo": {"weight": normal(12, (F // 2, D), F**-0.5)},
    }
    gate = normal(14, (D, 1), 0.5)
    params = {
        **layer_params(w),
        "shared_expert": jax.device_put(shared),
        "shared_expert_gate": {"weight": jax.device_put(gate)},
    }
    y, _ = _jitted(model)(params, jax.device_put(x))
    want, _ = ref_moe(x, w, top_k=2, capacity_factor=None, renormalize=False)
    sw = {k: np.asarray(v["weight"], np.float64) for k, v in shared.items()}
    xs = x.astype(np.float64)
    dense = (ref_act("silu")(xs @ sw["wi_gate"]) * (xs @ sw["wi_up"])) @ sw["wo"]
    sigmoid = 1.0 / (1.0 + np.exp(-(xs @ gate.astype(np.float64))))  # [g, s, 1]
    assert_close(y, want + sigmoid * dense)
    assert float(np.abs(sigmoid - 0.5).max()) > 0.1  # the gate really varies per token


def test_default_layer_has_no_shared_expert_gate_and_computes_as_before():
    x, w = skewed_case()
    plain = moe_cfg("gather", num_shared_experts=1)
    assert plain.shared_expert_gate is False
    specs = plain.instantiate(parent=None).create_parameter_specs_recursively()
    assert "shared_expert_gate" not in specs
    shared = dense_ffn_params()
    y, _ = run(plain, {**layer_params(w), "shared_expert": shared}, x)
    want, _ = ref_moe(x, w, top_k=2, capacity_factor=1.0)
    sw = {k: np.asarray(v["weight"], np.float64) for k, v in shared.items()}
    xs = x.astype(np.float64)
    assert_close(y, want + (ref_act("silu")(xs @ sw["wi_gate"]) * (xs @ sw["wi_up"])) @ sw["wo"])
    with pytest.raises(ConfigError, match=r"shared_expert_gate.*set num_shared_experts >= 1"):
        moe_cfg(shared_expert_gate=True).instantiate(parent=None)
    with pytest.raises(ConfigError, match="shared_expert_gate=True gates the shared experts"):
        small_lm("moe:shared_expert_gate=True")


def _decode_logits(model, params, ids, prompt):
    """Logits of every position: a prefill of `prompt` tokens, then one token per call."""

    def step(p, i, pos, c):
        inputs = {"input_ids": i, "positions": pos, "cache_state": c}
        out, _ = functional(
            model, prng_key=None, state=p, inputs=inputs, is_training=False, method="extend_step"
        )
        return out

    step = jax.jit(step)
    batch, total = ids.shape
    cache = jax.jit(model.init_cache_state, static_argnums=(0, 1))(batch, total)  # one program
    positions = np.broadcast_to(np.arange(total, dtype=np.int32), ids.shape)
    logits, cache = step(params, ids[:, :prompt], positions[:, :prompt], cache)
    out = [np.asarray(logits)]
    for t in range(prompt, total):
        logits, cache = step(params, ids[:, t : t + 1], positions[:, t : t + 1], cache)
        out.append(np.asarray(logits))
    return np.concatenate(out, axis=1)


QWEN_MOE = "moe:num_experts=4,top_k=2,capacity_factor=None,renormalize=False"


@pytest.mark.parametrize(
    "modifiers",
    [
        # Qwen2-MoE: a gated shared expert, raw top-k probabilities, every layer MoE.
        (f"{QWEN_MOE},num_shared_experts=1,shared_hidden_dim=24,shared_expert_gate=True",),
        # decoder_sparse_step=2 (dense, then MoE), scanned, with per-head q/k RMSNorm.
        (f"{QWEN_MOE},every=2,num_shared_experts=1,shared_expert_gate=True", "scan_layers"),
    ],
    ids=["gated_shared_raw_top_k", "every2_qk_norm_scanned"],
)
def test_decoding_with_the_cache_gives_the_forward_logits(modifiers):
    from axplug.api.layers import RMSNorm

    # Every layer MoE: one layer shows its decode (a second compiled the same layer again);
    # every=2: two groups, so that the scan runs over more than one.
    cfg = small_lm(layers=4 if "every=2" in modifiers[0] else 1)
    if "scan_layers" in modifiers:
        cfg.model.decoder.transformer.layer.attention.qk_norm = RMSNorm.default_config()
    for spec in modifiers:
        cfg = make_modifier(spec)(cfg)
    model = cfg.model.instantiate()
    # Every parameter random in numpy (no initializer to run), norm scales and gates too.
    shapes = jax.eval_shape(model.initialize_parameters_recursively, jax.random.PRNGKey(0))
    rng = np.random.default_rng(7)
    params = jax.tree_util.tree_map_with_path(
        lambda path, a: (path[-1].key == "scale") + 0.3 * rng.standard_normal(a.shape, a.dtype),
        shapes,
    )
    ids = np.random.default_rng(1).integers(0, 64, (2, 8)).astype(np.int32)
    full, _ = jax.jit(
        lambda p, i: functional(
            model, prng_key=None, state=p, inputs=(i,), is_training=False, method="predict"
        )
    )(params, ids)
    decoded = _decode_logits(model, params, ids, prompt=4)
    np.testing.assert_allclose(decoded, np.asarray(full), **F32_LOOSE)


def test_a_stack_of_groups_reads_and_writes_hugging_face_depth():
    from axplug.api import HFFields

    for scan in (False, True):
        stack = small_lm("moe:num_experts=4,every=2", scan=scan).model.decoder.transformer
        fields = HFFields({"num_hidden_layers": 6})
        stack.klass.hf_read(stack, fields)
        assert (stack.num_layers, fields.problems) == (3, [])
        assert stack.klass.hf_write(stack) == {"num_hidden_layers": 6}
        fields = HFFields({"num_hidden_layers": 5})
        stack.klass.hf_read(stack, fields)
        assert fields.problems == [
            "num_hidden_layers=5 is not a multiple of the 2 layers of each MoELayerGroup of "
            "the stack"
        ]
    plain = small_lm().model.decoder.transformer
    assert plain.klass.hf_write(plain) == {"num_hidden_layers": 4}


def test_capacity_is_per_sequence_and_bounded():
    assert expert_capacity(256, 8, 2, 1.25) == 80
    assert expert_capacity(8, 4, 2, 1.0) == 4
    assert expert_capacity(1, 8, 2, 1.25) == 1  # decoding one token never drops
    assert expert_capacity(8, 2, 2, 4.0) == 8  # never more slots than tokens
    assert expert_capacity(8, 4, 2, None) == 8  # drop-free


@pytest.mark.parametrize("dispatch", DELEGATES)  # `auto`: `balanced` here (drop-free)
def test_bfloat16_compute_runs_on_cpu_and_stays_close(dispatch):
    # bf16 x bf16 -> f32 einsums can compile and then fail to run on XLA:CPU (shared FACTS).
    x, w = skewed_case()
    # Drop-free: a bf16 rounding of a router logit can never move a choice past capacity.
    y16, _ = run(
        moe_cfg(dispatch, capacity_factor=None, compute_dtype="bfloat16"), layer_params(w), x
    )
    want, _ = ref_moe(x, w, top_k=2, capacity_factor=None)
    assert y16.dtype == jnp.bfloat16
    scale = float(np.abs(want).max())
    np.testing.assert_allclose(np.asarray(y16, np.float32), want, rtol=0, atol=3e-2 * scale)


def test_auto_dispatch_choice():
    assert AutoDispatch.choose("cpu", 80, 256) == "gather"
    assert AutoDispatch.choose("cpu", 256, 256) == "balanced"
    assert AutoDispatch.choose("gpu", 80, 256) == "gather"
    assert AutoDispatch.choose("gpu", 256, 256) == "ragged"
    assert AutoDispatch.choose("tpu", 256, 256) == "ragged"
    assert AutoDispatch.choose("cpu", 256, 256, expert_shards=2) == "alltoall"
    assert AutoDispatch.choose("gpu", 256, 256, expert_shards=4) == "alltoall"
    assert AutoDispatch.choose("cpu", 80, 256, expert_shards=2) == "gather"


def test_layer_config_errors_name_the_field():
    with pytest.raises(ConfigError, match=r"model\.router\.top_k: 5 must be between 1 and"):
        moe_cfg(top_k=5).instantiate(parent=None)
    with pytest.raises(ConfigError, match=r"model\.router\.capacity_factor: 0.0 must be > 0"):
        moe_cfg(capacity_factor=0.0).instantiate(parent=None)
    with pytest.raises(ConfigError, match=r"model\.activation: unknown activation 'swish2'"):
        moe_cfg(activation="swish2").instantiate(parent=None)


def test_expert_parameters_carry_the_expert_mesh_axis():
    specs = moe_cfg(gated=True).instantiate(parent=None).create_parameter_specs_recursively()
    assert specs["wi_gate"].mesh_axes == ("expert", "embed", "mlp")
    assert specs["wi_up"].mesh_axes == ("expert", "embed", "mlp")
    assert specs["wo"].mesh_axes == ("expert", "mlp", "embed")
    assert specs["router"]["weight"].shape == (D, E)  # no bias


def test_mixtral_8x7b_layout_matches_the_published_model():
    cfg = preset_config("mixtral-8x7b")
    moe = cfg.model.decoder.transformer.layer.feed_forward
    assert moe.klass is MoEFeedForward and moe.num_experts == 8 and moe.router.top_k == 2
    model = cfg.model.instantiate()
    specs = model.create_parameter_specs_recursively()["decoder"]["transformer"]["layer"]
    shapes = {k: v.shape for k, v in specs["feed_forward"].items() if k != "router"}
    # Per expert SwiGLU w1 / w3 [d, hidden] and w2 [hidden, d]; router [d, experts], no bias;
    # the leading 32 is the scanned layer axis.
    assert shapes == {
        "wi_gate": (32, 8, 4096, 14336),
        "wi_up": (32, 8, 4096, 14336),
        "wo": (32, 8, 14336, 4096),
    }
    assert specs["feed_forward"]["router"] == {"weight": specs["feed_forward"]["router"]["weight"]}
    assert specs["feed_forward"]["router"]["weight"].shape == (32, 4096, 8)
    assert "shared_expert" not in specs["feed_forward"]


# ------------------------------------------------------------------------------ modifier


def small_lm(*modifiers, layers=4, scan=False):
    cfg = preset_config(
        "llama-tiny",
        overrides=[
            "model.decoder.dim=32",
            "model.decoder.vocab_size=64",
            f"model.decoder.transformer.num_layers={layers}",
            "model.decoder.transformer.layer.attention.num_heads=4",
            "model.decoder.transformer.layer.feed_forward.hidden_dim=48",
        ],
    )
    if scan:
        cfg = make_modifier("scan_layers")(cfg)
    for spec in modifiers:
        cfg = make_modifier(spec)(cfg)
    return cfg


def paths(cfg, cls):
    return [p for p, _ in find_configs(cfg, cls)]


@pytest.mark.parametrize("scan", [False, True], ids=["stacked", "scanned"])
def test_modifier_every_layer_swaps_each_dense_ffn_carrying_dims(scan):
    base = small_lm(scan=scan)
    cfg = make_modifier("moe:num_experts=4,top_k=1,capacity_factor=2")(base)
    assert paths(cfg, FeedForward) == []
    (path, moe), *rest = find_configs(cfg, MoEFeedForward)
    assert rest == [] and path == "model.decoder.transformer.layer.feed_forward"
    assert (moe.hidden_dim, moe.activation, moe.gated) == (48, "silu", True)
    assert (moe.num_experts, moe.router.top_k, moe.router.capacity_factor) == (4, 1, 2.0)
    assert isinstance(moe.router.capacity_factor, float)
    assert (
        "model.decoder.transformer.layer.feed_forward.klass: axplug_moe.layer:MoEFeedForward"
        in (cfg.debug_string())
    )
    model = cfg.model.instantiate()
    specs = model.create_parameter_specs_recursively()["decoder"]["transformer"]
    layer = specs["layer"] if scan else specs["layer3"]
    lead = (4,) if scan else ()
    assert layer["feed_forward"]["wi_up"].shape == (*lead, 4, 32, 48)


@pytest.mark.parametrize("scan", [False, True], ids=["stacked", "scanned"])
def test_modifier_every_second_layer_groups_the_stack(scan):
    cfg = small_lm("moe:num_experts=4,top_k=2,every=2", scan=scan)
    stack = cfg.model.decoder.transformer
    assert stack.klass is (RepeatedTransformer if scan else StackedTransformer)
    assert stack.num_layers == 2 and stack.layer.klass is MoELayerGroup
    assert stack.layer.every == 2
    assert stack.layer.layer.feed_forward.klass is FeedForward
    assert stack.layer.moe_layer.feed_forward.klass is MoEFeedForward
    assert stack.layer.moe_layer.feed_forward.hidden_dim == 48
    model = cfg.model.instantiate()
    specs = model.create_parameter_specs_recursively()["decoder"]["transformer"]
    groups = [specs["layer"]] if scan else [specs["layer0"], specs["layer1"]]
    for group in groups:
        assert "weight" in group["layer0"]["feed_forward"]["wi_up"]  # dense
        assert group["layer1"]["feed_forward"]["router"]["weight"].shape[-2:] == (32, 4)
    # 4 transformer layers, 2 of them MoE: the parameter count says so.
    dense = small_lm().model.instantiate().create_parameter_specs_recursively()
    count = lambda t: sum(  # noqa: E731
        math.prod(s.shape) for s in jax.tree.leaves(t, is_leaf=lambda s: hasattr(s, "shape"))
    )
    ffn = 3 * 32 * 48
    assert count(specs) - count(dense["decoder"]["transformer"]) == 2 * (3 * ffn + 32 * 4)
    # Traced, not compiled: the every-second-layer model runs in the training tests below.
    ids = jax.ShapeDtypeStruct((2, 8), jnp.int32)
    params = jax.eval_shape(model.initialize_parameters_recursively, jax.random.PRNGKey(0))
    (loss, _), collection = jax.eval_shape(
        lambda p, i: functional(model, prng_key=None, state=p, inputs=(i, i), is_training=False),
        params,
        ids,
    )
    assert loss.shape == ()
    from axplug.api.run import collect_outputs

    emitted = [(p, n) for p, n, _ in collect_outputs(collection.module_outputs)]
    if scan:  # stacked along the scan axis: one entry per name
        assert emitted == [
            ("decoder.transformer.layer.layer1.feed_forward.router", "load_balance_loss"),
            ("decoder.transformer.layer.layer1.feed_forward.router", "router_z_loss"),
        ]
    else:
        assert sorted(p for p, _ in emitted) == sorted(
            [f"decoder.transformer.layer{i}.layer1.feed_forward.router" for i in (0, 1)] * 2
        )


def test_modifier_carries_gelu_ungated_from_gpt_tiny():
    cfg = make_modifier("moe:num_experts=2,top_k=1")(preset_config("gpt-tiny"))
    (_, moe), *_ = find_configs(cfg, MoEFeedForward)
    assert (moe.gated, moe.activation, moe.hidden_dim) == (False, "gelu", 512)


def test_modifier_reapplies_as_update_and_never_mutates_its_input():
    base = small_lm()
    before = base.debug_string()
    once = make_modifier("moe:num_experts=4,top_k=2,every=2")(base)
    assert base.debug_string() == before
    twice = make_modifier("moe:num_experts=8,top_k=1,every=2,dispatch=einsum")(once)
    moe = twice.model.decoder.transformer.layer.moe_layer.feed_forward
    assert (moe.num_experts, moe.router.top_k) == (8, 1)
    assert moe.dispatch.klass is DISPATCHERS["einsum"]
    assert twice.model.decoder.transformer.num_layers == 2  # not halved again
    with pytest.raises(ConfigError, match="already applied with every=2; cannot change"):
        make_modifier("moe:every=1")(once)


def test_modifier_errors():
    with pytest.raises(ConfigError, match=r"modifier 'moe': every=3 must divide model\."):
        small_lm("moe:every=3")
    with pytest.raises(ConfigError, match="modifier 'moe': top_k=3 must be between 1 and"):
        small_lm("moe:num_experts=2,top_k=3")
    with pytest.raises(ConfigError, match="unknown dispatch 'fast'; choose from auto"):
        small_lm("moe:dispatch=fast")
    with pytest.raises(ConfigError, match="modifier 'moe': .*nun_experts: unknown field"):
        make_modifier("moe:nun_experts=4")
    layer = TransformerLayer.default_config()
    with pytest.raises(ConfigError, match="every=2 needs a StackedTransformer or Repeated"):
        make_modifier("moe:every=2")(layer)
    with pytest.raises(ConfigError, match="no dense FeedForward in a feed_forward slot"):
        make_modifier("moe")(FeedForward.default_config())


@pytest.mark.parametrize("name", ["moe-tiny", "moe-fine-tiny", "mixtral-tiny"])
def test_plugin_presets_build_and_trace(name):
    cfg = preset_config(name)
    assert find_configs(cfg, MoEFeedForward)
    model = cfg.model.instantiate()
    ids = jax.ShapeDtypeStruct((2, 16), jnp.int32)
    params = jax.eval_shape(model.initialize_parameters_recursively, jax.random.PRNGKey(0))
    (loss, _), _ = jax.eval_shape(
        lambda p, i: functional(model, prng_key=None, state=p, inputs=(i, i), is_training=False),
        params,
        ids,
    )
    assert loss.shape == ()


# -------------------------------------------------------------- training and parallelism


def tiny_llama(run_dir, steps, mesh=(1, 1, 1, 1, 1)):
    return tiny_trainer_config(
        run_dir,
        "log_every=1",
        "checkpoint_every=1000",
        "model.decoder.dim=64",
        "model.decoder.transformer.num_layers=2",
        "model.decoder.transformer.layer.attention.num_heads=4",
        "model.decoder.transformer.layer.feed_forward.hidden_dim=128",
        "learner.warmup_steps=0",
        "learner.learning_rate=1e-2",
        f"mesh.mesh_shape={mesh}",
        preset="llama-tiny",
        max_steps=steps,
    )


def with_jsonl(cfg):
    from axplug.api.summary import JsonlWriter

    return cfg.clone(summary_writers=[JsonlWriter.default_config()])


def metrics(run_dir):
    from axplug.api.summary import read_jsonl

    return [r for r in read_jsonl(run_dir / "metrics.jsonl") if "loss" in r]


def every_second_layer_moe(run_dir, mesh):
    """2 small llama-tiny layers, the second MoE (8 experts of hidden 96, top-2, capacity
    1.25; the dense layer has hidden 128)."""
    cfg = tiny_llama(run_dir, STEPS, mesh)
    cfg = make_modifier("moe:num_experts=8,top_k=2,every=2,hidden_dim=96")(cfg)
    assert cfg.model.decoder.transformer.num_layers == 1  # one group: (dense, MoE)
    return with_jsonl(cfg)


STEPS = 6


@pytest.fixture(scope="module")
def one_device_run(tmp_path_factory):
    """Each step's metrics, the final parameters and the initial state (on the host) of
    `every_second_layer_moe` trained on one device by its built step (a run's checkpoint and
    writers are not what the tests here check). The meshes start from that state: one init
    compiles, and their step is the claim, not the sharded init (the core's sharding tests)."""
    trainer = every_second_layer_moe(tmp_path_factory.mktemp("one"), (1, 1, 1, 1, 1))
    trainer = trainer.instantiate(devices=jax.devices()[:1])
    start = jax.tree.map(np.array, jax.device_get(trainer.init_state()))
    state, rows = train_steps(trainer, STEPS, start)
    rows = [{k: float(v) for k, v in r.items() if k != "histograms"} for r in rows]
    return rows, jax.device_get(state["params"]), start


def test_moe_trains_with_aux_losses_in_the_loss_and_the_metrics(one_device_run):
    rows, _, _ = one_device_run
    losses = [r["loss"] for r in rows]
    print(f"loss {losses[0]:.3f} -> {losses[-1]:.3f}")
    assert len(rows) == STEPS and all(map(math.isfinite, losses))
    assert losses[-1] < losses[0] - 0.5, losses
    for r in rows:
        # One MoE layer, 0.01 x (1.0 when balanced, at most num_experts): coefficient applied.
        assert 0.009 < r["load_balance_loss"] < 0.05
        assert 0 < r["router_z_loss"] < 0.1
        assert r["loss"] == pytest.approx(
            r["ce_loss"] + r["load_balance_loss"] + r["router_z_loss"], rel=1e-5
        )


def _collectives(hlo: str) -> list[tuple[str, str]]:
    """(collective op, result shape) of every collective in an optimized HLO module."""
    found = re.findall(
        r"= (.*?) (all-to-all|all-gather|all-reduce|reduce-scatter|collective-permute)"
        r"(?:-start)?\(",
        hlo,
    )
    return [(op, shape) for shape, op in found]


@pytest.mark.parametrize(
    "mesh",
    [
        (2, 2, 2, 1, 1),
        pytest.param((1, 1, 8, 1, 1), marks=pytest.mark.slow),
        pytest.param((1, 4, 2, 1, 1), marks=pytest.mark.slow),
    ],
    ids=["data2_fsdp2_expert2", "expert8", "fsdp4_expert2"],
)
def test_expert_parallel_runs_match_one_device(tmp_path, one_device_run, mesh):
    assert jax.device_count() == 8, "the root conftest.py sets 8 fake CPU devices"
    trainer = every_second_layer_moe(tmp_path, mesh).instantiate()
    # The built train step alone: a checkpoint of 8 devices' shards is not what is tested.
    want_rows, want_params, start = one_device_run
    state, rows = train_steps(trainer, STEPS, start)
    np.testing.assert_allclose([r["loss"] for r in rows], [r["loss"] for r in want_rows], rtol=1e-4)
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-3, atol=5e-4),
        jax.device_get(state["params"]),
        want_params,
    )
    # Experts live on their shard of the `expert` axis...
    moe = state["params"]["decoder"]["transformer"]["layer0"]["layer1"]["feed_forward"]
    assert moe["wi_up"].sharding.spec[0] == "expert"
    experts_per_device = 8 // mesh[2]
    assert moe["wi_up"].addressable_shards[0].data.shape[0] == experts_per_device
    # ...tokens travel to them by all-to-all, and no collective ever materializes more experts
    # than a device owns (FSDP all-gathers stay within the device's experts).
    hlo = trainer._train_step.lower(state, trainer.put_batch(trainer.input.batch(0)))
    collectives = _collectives(hlo.compile().as_text())
    assert any(op == "all-to-all" for op, _ in collectives), collectives
    full_expert = re.compile(r"f32\[8,(64|32),96\]|f32\[8,96,(64|32)\]")
    assert not [c for c in collectives if full_expert.search(c[1])], collectives


@pytest.mark.slow
def test_cli_trains_llama_tiny_with_the_moe_modifier(tmp_path):
    moe = ["moe:num_experts=4,top_k=2"]
    # llama-tiny's own width: the tiny trainer's would not learn the corpus in 20 steps.
    full = ("model.decoder.dim=256", "model.decoder.transformer.layer.feed_forward.hidden_dim=704")
    args = tiny_train_args(tmp_path, *full, "log_every=10", "input.seq_len=128",
                           preset="llama-tiny", modifiers=moe, max_steps=20)  # fmt: skip
    assert main(args) == 0
    rows = metrics(tmp_path)
    assert [r["step"] for r in rows] == [10, 20]
    assert rows[-1]["loss"] < math.log(256) - 1.5  # bytes: from ~ln(256) toward the corpus
    assert all("load_balance_loss" in r and "router_z_loss" in r for r in rows)


# --------------------------------------------------------------- the conformance kit

from axplug_testing import LayerConformance  # noqa: E402


class TestMoEFeedForwardConformance(LayerConformance):
    """The kit on the MoE layer: experts over the `expert` mesh axis, swapped for gpt-tiny's
    dense feed-forward (the default `swap_target`)."""

    @pytest.fixture
    def layer_config(self):
        return moe_cfg("auto", capacity_factor=2.0)

    @pytest.fixture
    def inputs(self, input_shape):
        return (jax.device_put(normal(1, input_shape)),)  # numpy: no random program to compile

    @pytest.fixture
    def mesh_shape(self):
        return (2, 1, 2, 1, 2)  # data, expert and model parallel at once


def test_reapplying_moe_resets_the_options_it_owns():
    # mixtral-tiny is drop-free (capacity_factor=None); `moe` applied again without the option
    # takes the modifier's default, as every modifier does (docs/plugin-reference.md).
    from axplug_moe import MoEFeedForward

    from axplug.api.config import find_configs, make_modifier, preset_config

    cfg = preset_config("mixtral-tiny")
    (router,) = {ffn.router.capacity_factor for _, ffn in find_configs(cfg, MoEFeedForward)}
    assert router is None
    again = make_modifier("moe")(cfg)
    default = make_modifier("moe").config.capacity_factor
    assert {ffn.router.capacity_factor for _, ffn in find_configs(again, MoEFeedForward)} == {
        default
    }
    assert default == 1.25
