"""RepeatedPatternTransformer: a patterned stack (Gemma 2 / 3) scanned one period at a time,
the layers after the last whole period unrolled.

The scanned form against the unrolled one with the same parameters mapped (forward and
gradients under each remat policy), KV-cache decoding against the forward pass, `scan_layers`
on a patterned stack and on a Gemma 3 config.json, the parameter and cache trees, the errors,
and Gemma 2 / 3 imported scanned against transformers (exported back and reloaded).

Tolerances: float32 stacks 1e-6 against the unrolled form (the same operations in another
order of compilation); whole models decoded token by token 1e-4 (test_pattern's).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from axplug_models.pattern import PatternedTransformer
from axplug_models.pattern_scan import RepeatedPatternTransformer, scan_period

from axplug.api.config import ConfigError, from_dict, make_modifier, to_dict
from axplug.api.interop import differences
from test_pattern import (
    GEMMA3_LIKE,
    LOOSE,
    VOCAB,
    build,
    call,
    decode_logits,
    jit_call,
    lm,
    normal,
    positions,
    stack_cfg,
)

SAME = dict(rtol=1e-6, atol=1e-6)
KINDS = GEMMA3_LIKE["kinds"]
# Two whole periods of three, then two layers left: the scan steps and the tail both matter.
EIGHT = ("local", "local", "global") * 2 + ("local", "local")


def scanned(pattern=EIGHT, **fields) -> RepeatedPatternTransformer.Config:
    return PatternedTransformer.scanned_config(
        stack_cfg(pattern, KINDS), remat_policy=fields.pop("remat_policy", "none")
    ).set(**fields)


def to_scanned(params: dict, num_layers: int, period: int) -> dict:
    """The unrolled stack's `layer{i}` parameters (or caches) in the scanned tree."""
    steps = num_layers // period
    out = {
        "layer": {
            "layer": {
                f"layer{k}": jax.tree.map(
                    lambda *a: np.stack(a),  # numpy: no program per shape
                    *[params[f"layer{r * period + k}"] for r in range(steps)],
                )
                for k in range(period)
            }
        }
    }
    tail = {f"layer{j}": params[f"layer{steps * period + j}"] for j in range(num_layers % period)}
    return {**out, "tail": tail} if tail else out


def shapes(tree):
    return jax.tree.map(lambda a: (a.shape, a.dtype), tree)


def abstract(cfg):
    """The model of `cfg` and its parameters' shapes: no values, nothing to compute."""
    model = cfg.instantiate(parent=None)
    return model, jax.eval_shape(model.initialize_parameters_recursively, jax.random.PRNGKey(0))


# --- numerics against the unrolled stack --------------------------------------------------------


def test_scanned_forward_and_gradients_equal_the_unrolled_stacks():
    """Under each remat policy, against one unrolled reference."""
    unrolled, params = build(stack_cfg(EIGHT, KINDS))
    mapped = to_scanned(params, 8, 3)
    x, pos = normal(1, (2, 9, 32)), positions(2, 9)
    policies = ("none", "full", "dots")
    models = {}
    for policy in policies:
        model, own = abstract(scanned(remat_policy=policy))
        assert shapes(mapped) == shapes(own)
        models[policy] = model

    def forward_and_grads(m, p, x, pos):
        """The forward pass and the gradients of sum(sin(forward))."""

        def loss(p):
            out = call(m, p, {"x": x, "positions": pos})
            return jnp.sum(jnp.sin(out)), out

        (_, out), grads = jax.value_and_grad(loss, has_aux=True)(p)
        return out, grads

    # All four in one program: one compile, not four (the stacks stay apart: each policy's
    # scan and checkpoints are its own, and whatever XLA shares between them is the same
    # computation). Compiled (eager float32 differs from compiled by ~5e-6 here), at the
    # session's fast-compile flags: this one program gives the same results at them as at the
    # production options, every stack bit-equal to the reference at both (measured, jaxlib
    # 0.10.2, with and without the loop emitters), at half the production compile.
    @jax.jit
    def every_stack(params, mapped, x, pos):
        want = forward_and_grads(unrolled, params, x, pos)
        return want, {
            policy: forward_and_grads(models[policy], mapped, x, pos) for policy in policies
        }

    (want, want_grads), got_by_policy = every_stack(params, mapped, x, pos)
    want_grads = to_scanned(want_grads, 8, 3)
    for policy in policies:
        got, grads = got_by_policy[policy]
        close = functools.partial(np.testing.assert_allclose, **SAME, err_msg=policy)
        close(got, want)
        jax.tree.map(close, grads, want_grads)


def _primitives(jaxpr) -> list[str]:
    """The primitive names of a jaxpr's equations, those of nested jaxprs (scan bodies,
    checkpoints) included."""
    names = []
    for eqn in jaxpr.eqns:
        names.append(eqn.primitive.name)
        for value in eqn.params.values():
            inner = getattr(value, "jaxpr", value)
            if hasattr(inner, "eqns"):
                names += _primitives(inner)
    return names


@pytest.mark.parametrize("policy, checkpoints", [("none", 0), ("full", 5)])
def test_remat_is_per_layer_inside_the_scan_and_in_the_tail(policy, checkpoints):
    """One checkpoint per layer of the period (in the scan body) and per tail layer; the scan
    step itself is not one, so the backward pass holds one layer's activations at a time."""
    model, params = abstract(scanned(remat_policy=policy))
    x, pos = normal(1, (2, 9, 32)), positions(2, 9)
    jaxpr = jax.make_jaxpr(lambda p: call(model, p, {"x": x, "positions": pos}))(params)
    names = _primitives(jaxpr.jaxpr)
    assert names.count("scan") == 1
    assert sum("remat" in n or "checkpoint" in n for n in names) == checkpoints


def test_every_layer_keeps_its_kind_across_scan_steps_and_into_the_tail():
    model = scanned().instantiate(parent=None)
    assert [model.layer_config(i).attention.sliding_window for i in range(8)] == [
        None if kind == "global" else 3 for kind in EIGHT
    ]
    # ...and the tail's kinds matter: the scanned stack is not the unrolled one whose last
    # two layers are global.
    unrolled, params = build(stack_cfg(EIGHT, KINDS))
    x, pos = normal(2, (1, 9, 32)), positions(1, 9)
    got = jit_call(model, to_scanned(params, 8, 3), {"x": x, "positions": pos})
    global_tail = stack_cfg(EIGHT[:6] + ("global", "global"), KINDS).instantiate(parent=None)
    other = jit_call(global_tail, params, {"x": x, "positions": pos})
    assert float(np.max(np.abs(np.asarray(other) - np.asarray(got)))) > 1e-3  # numpy: no program


def test_the_trees_are_one_period_stacked_and_the_tail_unrolled():
    model = scanned().instantiate(parent=None)
    specs = model.create_parameter_specs_recursively()
    assert sorted(specs) == ["layer", "tail"]
    assert sorted(specs["layer"]["layer"]) == ["layer0", "layer1", "layer2"]
    assert sorted(specs["tail"]) == ["layer0", "layer1"]
    norm = specs["layer"]["layer"]["layer2"]["attention_norm"]["scale"]
    assert norm.shape == (2, 32) and norm.mesh_axes[0] == "layers"
    assert specs["tail"]["layer1"]["attention_norm"]["scale"].shape == (32,)
    cache = model.init_cache_state(3, 10)
    unrolled_cache = stack_cfg(EIGHT, KINDS).instantiate(parent=None).init_cache_state(3, 10)
    assert shapes(cache) == shapes(to_scanned(unrolled_cache, 8, 3))
    # A whole number of periods has no tail.
    assert "tail" not in abstract(scanned(EIGHT[:6]))[1]


# --- decoding -----------------------------------------------------------------------------------


@pytest.mark.parametrize("mods", [(), ("paged_kv_cache:page_size=4",)], ids=["contiguous", "paged"])
def test_scanned_decoding_with_the_cache_gives_the_forward_logits(mods):
    unrolled, base = build(lm(*mods))
    model = lm("scan_layers:remat_policy=full", *mods).instantiate(parent=None)
    decoder = {**base["decoder"], "transformer": to_scanned(base["decoder"]["transformer"], 5, 3)}
    params = {**base, "decoder": decoder}
    ids = np.random.default_rng(3).integers(0, VOCAB, (3, 11)).astype(np.int32)
    full = np.asarray(jax.jit(lambda p, i: call(model, p, (i,), "predict"))(params, ids))
    want = np.asarray(jax.jit(lambda p, i: call(unrolled, p, (i,), "predict"))(base, ids))
    np.testing.assert_allclose(full, want, **SAME)
    decoded, cache = decode_logits(model, params, ids, prompt_lens=[5, 2, 7], max_len=12)
    np.testing.assert_allclose(decoded, full, **LOOSE)
    assert sorted(cache["transformer"]) == ["layer", "tail"]


# --- scan_layers --------------------------------------------------------------------------------


def test_scan_layers_scans_a_patterned_stack_and_updates_it_when_applied_again():
    cfg = make_modifier("scan_layers:remat_policy=full")(lm())
    stack = cfg.decoder.transformer
    assert stack.klass is RepeatedPatternTransformer
    assert (stack.pattern, stack.kinds, stack.remat_policy) == (
        GEMMA3_LIKE["pattern"],
        KINDS,
        "full",
    )
    assert stack.layer.attention.qkv.num_kv_heads == 2  # the template came along
    again = make_modifier("scan_layers:remat_policy=dots")(cfg).decoder.transformer
    assert again.klass is RepeatedPatternTransformer and again.remat_policy == "dots"
    assert to_dict(again.clone(remat_policy="full")) == to_dict(stack)
    # The config round-trips, and an unrolled and a scanned stack compute the same thing.
    assert to_dict(from_dict(to_dict(stack))) == to_dict(stack)
    assert differences(stack.clone(period=3), lm().decoder.transformer) == []


def test_shortest_period():
    cfg = scanned()
    assert scan_period(cfg) == 3
    gemma3 = ((["sliding"] * 5 + ["full"]) * 5)[:26]
    assert scan_period(cfg.clone(num_layers=26, pattern=tuple(gemma3))) == 6
    assert scan_period(cfg.clone(num_layers=4, pattern=("local", "global") * 2)) == 2
    assert scan_period(cfg.clone(num_layers=3, pattern=("local", "global", "global"))) == 3
    assert scan_period(cfg.clone(period=6)) == 6  # a longer one the pattern repeats with


def test_hf_trainer_config_scans_a_gemma3_config_json():
    """Gemma 3 27B's config.json (the Hub's form: the period, no layer_types; 62 layers: ten
    periods of six, then two sliding layers) imports scanned, with the unrolled import's
    parameters."""
    transformers = pytest.importorskip("transformers")
    from axplug.api.config import resolve_preset
    from axplug.api.interop import hf_trainer_config, parse_hf_config

    raw = resolve_preset("gemma3-27b").config_json

    def model(*modifiers):
        cfg = hf_trainer_config(parse_hf_config(raw), output_dir="unused", modifiers=modifiers)
        return cfg.model, cfg.model.instantiate(parent=None)

    scan_cfg, scan = model("scan_layers:remat_policy=full")
    stack = scan.decoder.transformer
    assert type(stack) is RepeatedPatternTransformer
    assert stack.layer.config.num_layers == 10
    assert stack.tail.config.pattern == ("sliding_attention",) * 2
    _, unrolled = model()

    def count(m):
        specs = m.create_parameter_specs_recursively()
        return sum(int(np.prod(s.shape)) for s in jax.tree.leaves(specs))

    assert count(scan) == count(unrolled)
    types = transformers.Gemma3TextConfig(num_hidden_layers=62, sliding_window_pattern=6)
    assert [stack.layer_config(i).attention.sliding_window for i in range(62)] == [
        None if kind == "full_attention" else 1024 for kind in types.layer_types
    ]
    place = RepeatedPatternTransformer.hf_layer_path
    paths = [place(scan_cfg.decoder.transformer, i) for i in range(62)]
    assert len(set(paths)) == 62
    assert (paths[59], paths[60], paths[61]) == (
        "layer9.layer.layer5",
        "tail.layer0",
        "tail.layer1",
    )


# --- errors -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "fields, expected",
    [
        (
            {"period": 2},
            r"period: the pattern does not repeat every 2 layers: layer 2 is 'global', layer 0 "
            r"is 'local'; set a period it repeats with \(its shortest is 3\) or None",
        ),
        ({"period": 9}, r"period: 9 is not between 1 and num_layers \(8\)"),
        ({"num_layers": 6}, r"pattern: 8 kind\(s\) for num_layers=6"),
        ({"pattern": EIGHT[:7] + ("glob",)}, r"pattern: layer 7 has kind 'glob'"),
        ({"remat_policy": "ful"}, r"remat_policy: unknown policy 'ful'"),
        ({"kinds": {**KINDS, "local": {"attention.windw": 3}}}, r"kinds\['local'\]"),
    ],
    ids=[
        "period_not_repeated",
        "period_too_long",
        "pattern_length",
        "unknown_kind",
        "remat",
        "override",
    ],
)
def test_a_bad_pattern_or_period_is_an_error_naming_the_field(fields, expected):
    with pytest.raises(ConfigError, match=expected):
        scanned().set(**fields).instantiate(parent=None)


# --- against transformers -----------------------------------------------------------------------


S, F = "sliding_attention", "full_attention"


def _gemma3(layer_types: list[str]):
    pytest.importorskip("transformers")
    from test_families import FAMILIES

    base = FAMILIES["gemma3"]()
    fields = {**base.to_dict(), "num_hidden_layers": len(layer_types), "layer_types": layer_types}
    return type(base)(**fields)


@pytest.mark.parametrize(
    "layer_types, period",
    [
        ([S, F, S, F, S], 2),  # two scan steps, then one layer
        pytest.param([S, S, F, S, S, F, S, S], 3, marks=pytest.mark.slow),  # two, then two
    ],
    ids=["period2_tail1", "period3_tail2"],
)
def test_gemma3_imported_scanned_matches_transformers_and_exports(layer_types, period, tmp_path):
    from axplug_models.testing import check_against_transformers

    from axplug.api.run import load_checkpoint
    from test_families import TOL

    modifiers = ["scan_layers:remat_policy=full"]
    check = check_against_transformers(_gemma3(layer_types), tmp_path, modifiers=modifiers)
    assert not check.mismatches(TOL), check
    loaded = load_checkpoint(check.run_dir)
    stack = loaded.config.model.decoder.transformer
    assert stack.klass is RepeatedPatternTransformer and stack.remat_policy == "full"
    tree = loaded.params["decoder"]["transformer"]
    assert sorted(tree["layer"]["layer"]) == [f"layer{k}" for k in range(period)]
    assert tree["layer"]["layer"]["layer0"]["attention"]["qkv"]["q"]["weight"].shape[0] == 2
    assert len(tree["tail"]) == len(layer_types) - 2 * period


@pytest.mark.slow
def test_gemma2_imported_scanned_matches_transformers(tmp_path):
    """Gemma 2's layer_types derived from its period (2): five layers, two steps and one."""
    transformers = pytest.importorskip("transformers")
    from axplug_models.testing import check_against_transformers

    from test_families import FAMILIES, TOL

    base = FAMILIES["gemma2"]()
    config = transformers.Gemma2Config(
        **{**base.to_dict(), "num_hidden_layers": 5, "layer_types": None}
    )
    check = check_against_transformers(config, tmp_path, modifiers=["scan_layers"])
    assert not check.mismatches(TOL), check


def test_a_bad_period_on_import_is_one_error_line(tmp_path, capsys):
    pytest.importorskip("transformers")
    from axplug_models.testing import tiny_transformers_model
    from axplug_testing import cli_main as main

    tiny_transformers_model(_gemma3([S, S, F])).save_pretrained(tmp_path / "hf")
    capsys.readouterr()  # transformers' progress bars
    args = ["import-hf", str(tmp_path / "hf"), "--output", str(tmp_path / "run"),
            "--modifier", "scan_layers", "--set", "model.decoder.transformer.period=2"]  # fmt: skip
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert err[0].startswith("error: model.decoder.transformer.period: the pattern does not repeat")


@pytest.mark.slow
def test_aot_plans_the_gemma3_27b_preset_scanned(capsys):
    """The preset scans (ten periods of six and a tail of two) and `axplug aot` reports it so
    (the note that XLA counts a scanned layer's FLOPs once)."""
    pytest.importorskip("axplug_aot")
    import json

    from axplug_testing import cli_main as main

    argv = ["aot", "--preset", "gemma3-27b", "--mesh-rule", "gpu-h100-8x2", "--max-devices", "8",
            "--set", "input.batch_size=16", "--set", "input.seq_len=256", "--json"]  # fmt: skip
    main(argv)
    out, err = capsys.readouterr()
    assert out, err
    report = json.loads(out)
    assert report["scanned_layers"] is True and report["params"] == 27_009_346_304


def _paths(tree, prefix=""):
    if isinstance(tree, dict):
        return {p for key, value in tree.items() for p in _paths(value, f"{prefix}{key}.")}
    return {prefix[:-1]}


def test_decoder_tensors_places_each_layer_of_a_scanned_patterned_stack():
    """A family in the LLaMA layout (`decoder_tensors`) scanned: each layer's tensors go to
    its scan step's slot (`layer{r}.layer.layer{k}`, a slice of the stacked arrays) or the
    tail, and together they fill every parameter."""
    import re

    from axplug.api.interop import decoder_tensors

    cfg = lm("scan_layers")
    assert cfg.decoder.transformer.klass is RepeatedPatternTransformer
    specs = _paths(cfg.instantiate(parent=None).create_parameter_specs_recursively())
    rules = decoder_tensors(cfg)
    # A scanned stack's `layer{r}.rest` is slice r of `layer.rest` (as the import reads it).
    placed = {re.sub(r"^decoder\.transformer\.layer\d+\.", "decoder.transformer.layer.", p)
              for p in rules}  # fmt: skip
    assert placed == specs
    assert "decoder.transformer.tail.layer1.attention.qkv.q.weight" in rules
