"""Optimizers and schedules as components (`axplug.optimizers`, `axplug.schedules`); the
more of axplug-optimizers are tested in plugins/optimizers/tests."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from axplug.api import ParameterSpec
from axplug.cli.main import main
from axplug.config import ConfigDependencyError, ConfigError
from axplug.learner import OPTIMIZERS, SCHEDULES, Learner, clip_by_global_norm

# Learner fields away from their defaults, so a factory that ignored one would differ.
HYPER = dict(b1=0.8, b2=0.9, eps=1e-6, momentum=0.7, weight_decay=0.5)
LR = 0.1
ONES = jax.nn.initializers.ones
SPECS = {
    "w": ParameterSpec((4, 3), jnp.float32, ("embed", "mlp"), ONES),
    "norm": ParameterSpec((3,), jnp.float32, ("mlp",), ONES, weight_decay_scale=0.0),
    "b": ParameterSpec((3,), jnp.float32, ("mlp",), ONES),
}
MASK = {"w": True, "norm": False, "b": True}


def _params():
    k1, k2 = jax.random.split(jax.random.PRNGKey(0))
    return {
        "w": jax.random.normal(k1, (4, 3)),
        "norm": jnp.ones(3) + 0.1,
        "b": jax.random.normal(k2, (3,)),
    }


def _grads(step: int):
    keys = jax.random.split(jax.random.PRNGKey(100 + step), 3)
    params = _params()
    return {k: jax.random.normal(key, params[k].shape) for k, key in zip(params, keys, strict=True)}


def _learner(optimizer: str, schedule: str = "constant", **fields) -> Learner:
    cfg = Learner.default_config().set(
        optimizer=optimizer,
        schedule=schedule,
        learning_rate=LR,
        warmup_steps=0,
        max_grad_norm=None,
        **{**HYPER, **fields},
    )
    return cfg.instantiate()


def _references():
    """Each spec with optax's own transformation for the same hyperparameters."""
    h = HYPER
    lr = optax.constant_schedule(LR)  # what the learner passes: a schedule, even a constant
    return {
        "adamw": optax.adamw(
            lr, b1=h["b1"], b2=h["b2"], eps=h["eps"], weight_decay=h["weight_decay"], mask=MASK
        ),
        "adamw:mu_dtype=bfloat16": optax.adamw(
            lr,
            b1=h["b1"],
            b2=h["b2"],
            eps=h["eps"],
            weight_decay=h["weight_decay"],
            mask=MASK,
            mu_dtype=jnp.bfloat16,
        ),  # fmt: skip
        "adam": optax.adam(lr, b1=h["b1"], b2=h["b2"], eps=h["eps"]),
        "sgd": optax.chain(
            optax.add_decayed_weights(h["weight_decay"], MASK),
            optax.sgd(lr, momentum=h["momentum"]),
        ),
        "sgd:nesterov=True": optax.chain(
            optax.add_decayed_weights(h["weight_decay"], MASK),
            optax.sgd(lr, momentum=h["momentum"], nesterov=True),
        ),
    }


REFERENCES = _references()


@pytest.mark.parametrize("spec", list(REFERENCES))
def test_each_optimizer_matches_optax_over_three_steps(spec):
    tx = _learner(spec).transform(SPECS, 100)
    ref = REFERENCES[spec]
    params = ref_params = _params()
    state, ref_state = tx.init(params), ref.init(ref_params)
    assert jax.tree.structure(state) == jax.tree.structure(ref_state)
    for step in range(3):
        grads = _grads(step)
        updates, state = tx.update(grads, state, params)
        expected, ref_state = ref.update(grads, ref_state, ref_params)
        for name in params:
            np.testing.assert_allclose(updates[name], expected[name], rtol=1e-6, atol=1e-7)
        params = optax.apply_updates(params, updates)
        ref_params = optax.apply_updates(ref_params, expected)
    # The updates are not trivially equal for every spec: moving the parameters matters.
    assert not np.allclose(params["w"], _params()["w"])


def test_every_core_optimizer_is_covered_and_the_mask_holds():
    assert {s.partition(":")[0] for s in REFERENCES} == set(OPTIMIZERS)
    params = _params()
    for name in OPTIMIZERS:
        if name == "adam":
            continue  # no weight decay
        tx = _learner(name).transform({"norm": SPECS["norm"]}, 10)
        norm = {"norm": params["norm"]}
        updates, _ = tx.update({"norm": jnp.zeros(3)}, tx.init(norm), norm)
        np.testing.assert_array_equal(updates["norm"], 0.0, err_msg=name)


def test_adamw_keeps_the_optimizer_state_of_existing_checkpoints():
    """The tree the learner built before optimizers were components: chain(clip, adamw)."""
    cfg = Learner.default_config()
    learner = cfg.instantiate()
    old = optax.chain(
        clip_by_global_norm(cfg.max_grad_norm),
        optax.adamw(
            learner.schedule(100), b1=cfg.b1, b2=cfg.b2, eps=cfg.eps,
            weight_decay=cfg.weight_decay, mask=MASK,
        ),
    )  # fmt: skip
    new = learner.transform(SPECS, 100)
    params = _params()
    old_state, new_state = old.init(params), new.init(params)
    assert jax.tree.structure(old_state) == jax.tree.structure(new_state)
    assert str(jax.tree.structure(old_state)) == str(jax.tree.structure(new_state))
    updates, _ = new.update(_grads(0), new_state, params)
    expected, _ = old.update(_grads(0), old_state, params)
    for name in params:
        np.testing.assert_allclose(updates[name], expected[name], rtol=1e-6)


# ------------------------------------------------------------------------------- schedules


def _schedule(spec: str, total: int, **fields):
    cfg = Learner.default_config().set(schedule=spec, learning_rate=1.0, **fields)
    return cfg.instantiate().schedule(total)


def _values(schedule, steps):
    return [float(schedule(s)) for s in steps]


def test_constant_cosine_linear_keep_their_numerics():
    steps = [0, 5, 10, 60, 110, 200]
    cosine = _schedule("cosine", 110, warmup_steps=10, end_learning_rate_fraction=0.1)
    want = [0.0, 0.5, 1.0, 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)), 0.1, 0.1]
    np.testing.assert_allclose(_values(cosine, steps), want, rtol=1e-5, atol=1e-7)
    linear = _schedule("linear", 110, warmup_steps=10, end_learning_rate_fraction=0.2)
    want = [0.0, 0.5, 1.0, 1.0 - 0.5 * 0.8, 0.2, 0.2]
    np.testing.assert_allclose(_values(linear, steps), want, rtol=1e-5, atol=1e-7)
    constant = _schedule("constant", 110, warmup_steps=10)
    np.testing.assert_allclose(_values(constant, steps), [0, 0.5, 1, 1, 1, 1], atol=1e-7)


def test_every_core_schedule_builds_and_starts_at_the_peak():
    for name in SCHEDULES:
        lr = _schedule(name, 100, warmup_steps=10)
        np.testing.assert_allclose(float(lr(10)), 1.0, rtol=1e-6, err_msg=name)
        assert float(lr(0)) == 0.0, name


# ---------------------------------------------------------------------------- bad specs


@pytest.mark.parametrize(
    ("field", "spec", "message"),
    [
        (
            "optimizer",
            "adamx",
            "unknown 'adamx' (did you mean 'adam' or 'adamw'?); choose from ",
        ),
        ("schedule", "cosin", "unknown 'cosin' (did you mean 'cosine'?); choose from constant, "),
        (
            "optimizer",
            "adamw:mu_dtyp=bfloat16",
            "'adamw' has no option 'mu_dtyp' (did you mean 'mu_dtype'?); its options: mu_dtype",
        ),
        ("schedule", "cosine:cycles=2", "'cosine' takes no options, got 'cycles'"),
        ("optimizer", "sgd:nesterov='yes'", "sgd: option nesterov='yes' must be a bool"),
        ("optimizer", "adamw:b1=0.95", "its options: mu_dtype (b1 is a learner field: --set "),
        ("optimizer", "adamw:weight_decay_mask=None", "is set by the learner, not an option"),
        ("optimizer", "sgd:nesterov=True", "sgd:nesterov=True needs momentum"),
        ("optimizer", "adamw:mu_dtype=float99", "learner.optimizer: adamw:mu_dtype='float99': "),
    ],
)
def test_a_bad_spec_is_one_error_line_naming_the_field(capsys, field, spec, message):
    extra = ["--set", "learner.momentum=0"] if "nesterov=True" in spec else []
    argv = ["train", "--preset", "gpt-tiny", "--print-config", "--set", f"learner.{field}={spec}"]
    assert main([*argv, *extra]) == 2
    captured = capsys.readouterr()
    lines = [line for line in captured.err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "Traceback" not in captured.err, captured.err
    assert lines[0].startswith(f"error: learner.{field}: "), lines[0]
    assert message in lines[0], lines[0]
    assert captured.out == ""


def test_a_good_spec_prints_the_config(capsys):
    argv = ["train", "--preset", "gpt-tiny", "--print-config"]
    argv += ["--set", "learner.optimizer=sgd:nesterov=True"]
    argv += ["--set", "learner.schedule=linear"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "sgd:nesterov=True" in out and "learner.schedule: 'linear'" in out


def test_a_standalone_learner_config_names_the_learner():
    with pytest.raises(ConfigError, match=r"^learner.optimizer: unknown 'adamx' \(did you"):
        Learner.default_config().set(optimizer="adamx").instantiate()


@pytest.mark.parametrize(("field", "name"), [("optimizer", "lion"), ("schedule", "wsd")])
def test_a_plugins_name_without_the_plugin_points_to_the_docs(plugin_site, field, name):
    """Only the core is installed: the error lists its names and the page naming the plugins."""
    with pytest.raises(ConfigError) as info:
        Learner.default_config().set(**{field: name}).instantiate()
    kind = f"{field}s"
    listing = ", ".join(sorted(OPTIMIZERS if field == "optimizer" else SCHEDULES))
    assert str(info.value) == (
        f"learner.{field}: unknown {name!r}; choose from {listing} "
        f"(`axplug list --kind {kind}`; docs/plugin-reference.md names the first-party plugins "
        f"with more {kind})"
    )


# ------------------------------------------------------------------------------------ CLI


def test_list_shows_the_optimizers_and_schedules(capsys):
    assert main(["list", "--kind", "optimizers"]) == 0
    out = capsys.readouterr().out
    for name in OPTIMIZERS:
        assert f" {name} " in out, name
    assert main(["list", "--kind", "schedules"]) == 0
    out = capsys.readouterr().out
    for name in SCHEDULES:
        assert f" {name} " in out, name
    assert main(["list"]) == 0
    out = capsys.readouterr().out
    assert "optimizers" in out and "schedules" in out


# ----------------------------------------------------------------------- third parties

PLUGIN = '''
"""A third party's optimizer and schedule."""

import jax.numpy as jnp
import optax


def signum(learning_rate, cfg, *, weight_decay_mask=None, scale: float = 1.0):
    """Signed gradients (signSGD) with decoupled weight decay."""
    return optax.chain(
        optax.scale_by_sign(),
        optax.scale(scale),
        optax.add_decayed_weights(cfg.weight_decay, weight_decay_mask),
        optax.scale_by_learning_rate(learning_rate),
    )


def step_decay(peak, steps, cfg, *, every: int = 10, factor: float = 0.5):
    """The peak times factor ** (step // every)."""
    return lambda step: peak * factor ** (jnp.asarray(step) // every)


class NotAFactory:
    pass


def too_few(peak, steps):
    return None
'''


@pytest.fixture
def third_party(plugin_site):
    optimizers = {"signum": "fake_optim:signum", "klass": "fake_optim:NotAFactory"}
    schedules = {"step_decay": "fake_optim:step_decay", "few": "fake_optim:too_few"}
    plugin_site.add(
        "fake-optim",
        {"axplug.optimizers": optimizers, "axplug.schedules": schedules},
        modules={"fake_optim": PLUGIN},
    )
    return plugin_site


def test_a_plugin_registers_an_optimizer_and_a_schedule(third_party, capsys):
    learner = _learner(
        "signum:scale=2.0", schedule="step_decay:every=2,factor=0.5", weight_decay=0.0
    )
    lr = learner.schedule(100)
    np.testing.assert_allclose(_values(lr, [0, 1, 2, 5]), [LR, LR, LR / 2, LR / 4], rtol=1e-6)
    tx = learner.transform(SPECS, 100)
    params, grads = _params(), _grads(0)
    updates, _ = tx.update(grads, tx.init(params), params)
    np.testing.assert_allclose(updates["w"], -LR * 2.0 * np.sign(grads["w"]), rtol=1e-6)

    with pytest.raises(ConfigError, match=r"'signum' has no option 'scal' \(did you mean 'scale'"):
        _learner("signum:scal=2.0")
    with pytest.raises(ConfigError, match=r"signum: option scale='x' must be a float"):
        _learner("signum:scale='x'")
    with pytest.raises(ConfigError, match=r"unknown 'signun' \(did you mean 'signum'\?\)"):
        _learner("signun")
    assert main(["list", "--kind", "optimizers"]) == 0
    out = capsys.readouterr().out
    assert "fake-optim" in out and "signum" in out and "Signed gradients" in out


def test_a_factory_of_the_wrong_shape_is_a_broken_component(third_party):
    from axplug import registry

    with pytest.raises(registry.PluginLoadError, match="it must be a function make"):
        registry.load("optimizers", "klass")
    with pytest.raises(ConfigDependencyError, match=r"^learner.optimizer: cannot load"):
        _learner("klass")
    with pytest.raises(registry.PluginLoadError, match="takes 2 positional arguments"):
        registry.load("schedules", "few")
    broken = {c.name: c for c in registry.discover() if c.distribution == "fake-optim"}
    assert (broken["klass"].status, broken["klass"].failure) == ("broken", "kind")
