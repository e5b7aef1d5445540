"""axplug-optimizers: each optimizer against optax's own over three steps, each schedule
against its formula, their option checks, and training runs with them."""

import json
import math

import pytest

axplug_optimizers = pytest.importorskip("axplug_optimizers")

import jax
import jax.numpy as jnp
import numpy as np
import optax
from axplug_testing import cli_main as main
from axplug_testing import tiny_train_args, tiny_trainer_config

from axplug.api import ParameterSpec
from axplug.api.config import ConfigDependencyError, ConfigError
from axplug.api.run import Trainer

OPTIMIZERS = ("adafactor", "lion", "muon", "lamb")
SCHEDULES = ("wsd", "inverse_sqrt", "cosine_restarts")
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


def _learner_config():
    return Trainer.default_config().learner


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


def _learner(optimizer: str, schedule: str = "constant", **fields):
    cfg = _learner_config().set(
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
        "adafactor": optax.adafactor(
            lr, weight_decay_rate=h["weight_decay"], weight_decay_mask=MASK
        ),
        "adafactor:decay_rate=0.9,momentum=0.5": optax.adafactor(
            lr,
            decay_rate=0.9,
            momentum=0.5,
            weight_decay_rate=h["weight_decay"],
            weight_decay_mask=MASK,
        ),  # fmt: skip
        "lion": optax.lion(lr, b1=h["b1"], b2=h["b2"], weight_decay=h["weight_decay"], mask=MASK),
        "lamb": optax.lamb(
            lr, b1=h["b1"], b2=h["b2"], eps=h["eps"], weight_decay=h["weight_decay"], mask=MASK
        ),
        "muon": optax.contrib.muon(
            lr,
            eps=h["eps"],
            weight_decay=h["weight_decay"],
            weight_decay_mask=MASK,
            adam_b1=h["b1"],
            adam_b2=h["b2"],
        ),  # fmt: skip
        "muon:beta=0.9,ns_steps=3,adam_weight_decay=0.2": optax.contrib.muon(
            lr,
            beta=0.9,
            ns_steps=3,
            eps=h["eps"],
            weight_decay=h["weight_decay"],
            weight_decay_mask=MASK,
            adam_b1=h["b1"],
            adam_b2=h["b2"],
            adam_weight_decay=0.2,
        ),  # fmt: skip
    }


REFERENCES = _references()


@pytest.mark.parametrize("spec", list(REFERENCES))
def test_each_optimizer_matches_optax_over_three_steps(spec):
    tx = _learner(spec).transform(SPECS, 100)
    ref = REFERENCES[spec]
    params = ref_params = _params()
    state, ref_state = tx.init(params), ref.init(ref_params)
    assert jax.tree.structure(state) == jax.tree.structure(ref_state)
    # Each update compiled as one program (op by op, every op would compile for its shape).
    update, ref_update = jax.jit(tx.update), jax.jit(ref.update)
    for step in range(3):
        grads = _grads(step)
        updates, state = update(grads, state, params)
        expected, ref_state = ref_update(grads, ref_state, ref_params)
        for name in params:
            np.testing.assert_allclose(updates[name], expected[name], rtol=1e-6, atol=1e-7)
        params = optax.apply_updates(params, updates)
        ref_params = optax.apply_updates(ref_params, expected)
    # The updates are not trivially equal for every spec: moving the parameters matters.
    assert not np.allclose(params["w"], _params()["w"])


def test_every_optimizer_is_covered_and_the_mask_holds():
    assert {s.partition(":")[0] for s in REFERENCES} == set(OPTIMIZERS)
    params = _params()
    for name in OPTIMIZERS:
        tx = _learner(name).transform({"norm": SPECS["norm"]}, 10)
        norm = {"norm": params["norm"]}
        updates, _ = tx.update({"norm": jnp.zeros(3)}, tx.init(norm), norm)
        np.testing.assert_array_equal(updates["norm"], 0.0, err_msg=name)


def test_muon_without_it_in_optax_names_the_version(monkeypatch):
    from axplug_optimizers import optimizers

    monkeypatch.setattr(optimizers, "_optax_contrib", lambda: None)
    with pytest.raises(ConfigDependencyError) as info:
        _learner_config().set(optimizer="muon").instantiate()
    assert str(info.value).startswith("learner.optimizer: muon needs optax>=0.2.5")
    assert f"optax {optax.__version__} is installed" in str(info.value)


# ------------------------------------------------------------------------------- schedules


def _schedule(spec: str, total: int, **fields):
    cfg = _learner_config().set(schedule=spec, learning_rate=1.0, **fields)
    return cfg.instantiate().schedule(total)


def _values(schedule, steps):
    return [float(schedule(s)) for s in steps]


@pytest.mark.parametrize(
    ("shape", "left"),
    [
        ("linear", lambda p: 1 - p),
        ("cosine", lambda p: 0.5 * (1 + math.cos(math.pi * p))),
        ("sqrt", lambda p: 1 - math.sqrt(p)),
    ],
)
def test_wsd_warms_up_holds_the_peak_then_decays(shape, left):
    # 10 warmup steps, then 100: 80 at the peak and a decay over the last 20 (0.2).
    lr = _schedule(f"wsd:decay_fraction=0.2,shape={shape}", 110, warmup_steps=10)
    end = 0.1  # end_learning_rate_fraction's default
    expected = {
        0: 0.0,
        5: 0.5,
        10: 1.0,
        50: 1.0,
        90: 1.0,  # the plateau's last step
        95: end + (1 - end) * left(0.25),
        100: end + (1 - end) * left(0.5),
        110: end,
        500: end,
    }
    np.testing.assert_allclose(_values(lr, expected), list(expected.values()), rtol=1e-5)
    jitted = jax.jit(lr)(jnp.int32(95))
    np.testing.assert_allclose(jitted, expected[95], rtol=1e-5)


def test_inverse_sqrt_follows_its_formula():
    lr = _schedule("inverse_sqrt", 1000, warmup_steps=16)
    # After a 16-step warmup: sqrt(16 / t), t the absolute step.
    for t in (16, 32, 64, 400):
        np.testing.assert_allclose(float(lr(t)), math.sqrt(16 / t), rtol=1e-5)
    np.testing.assert_allclose(float(lr(8)), 0.5, rtol=1e-6)  # warmup
    lr = _schedule("inverse_sqrt:timescale=4", 1000, warmup_steps=16)
    np.testing.assert_allclose(float(lr(16 + 12)), math.sqrt(4 / 16), rtol=1e-5)
    with pytest.raises(ConfigError, match=r"learner.schedule: inverse_sqrt: needs a timescale"):
        _schedule("inverse_sqrt", 100, warmup_steps=0)


def test_cosine_restarts_restart_at_a_decayed_peak():
    lr = _schedule(
        "cosine_restarts:cycles=4,peak_decay=0.5", 100, warmup_steps=0,
        end_learning_rate_fraction=0.1,
    )  # fmt: skip

    def cycle(peak, t, length=25):
        return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t / length)))

    expected = {
        0: 1.0,
        10: cycle(1.0, 10),
        24: cycle(1.0, 24),
        25: 0.5,  # restart
        35: cycle(0.5, 10),
        50: 0.25,
        75: 0.125,
        99: cycle(0.125, 24),
        100: 0.0125,
        300: 0.0125,
    }
    np.testing.assert_allclose(_values(lr, expected), list(expected.values()), rtol=1e-5)


def test_every_schedule_builds_and_starts_at_the_peak():
    for name in SCHEDULES:
        lr = _schedule(name, 100, warmup_steps=10)
        np.testing.assert_allclose(float(lr(10)), 1.0, rtol=1e-6, err_msg=name)
        assert float(lr(0)) == 0.0, name


# ---------------------------------------------------------------------------- bad specs


@pytest.mark.parametrize(
    ("field", "spec", "message"),
    [
        ("schedule", "wsdd", "unknown 'wsdd' (did you mean 'wsd'?); choose from constant, "),
        (
            "schedule",
            "wsd:decay_fractoin=0.1",
            "'wsd' has no option 'decay_fractoin' (did you mean 'decay_fraction'?); its "
            "options: decay_fraction, shape",
        ),
        ("schedule", "wsd:shape=exp", "wsd: option shape='exp' must be one of 'linear', "),
        ("schedule", "wsd:decay_fraction=1.5", "wsd: decay_fraction must be in (0, 1], got 1.5"),
        ("schedule", "cosine_restarts:cycles=0", "cosine_restarts: cycles must be in [1, "),
        ("optimizer", "lion:b1=0.95", "its options: mu_dtype (b1 is a learner field: --set "),
        ("optimizer", "lionn", "unknown 'lionn' (did you mean 'lion'?); choose from "),
    ],
)
def test_a_bad_spec_is_one_error_line_naming_the_field(capsys, field, spec, message):
    argv = ["train", "--preset", "gpt-tiny", "--print-config", "--set", f"learner.{field}={spec}"]
    assert main(argv) == 2
    captured = capsys.readouterr()
    lines = [line for line in captured.err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "Traceback" not in captured.err, captured.err
    assert lines[0].startswith(f"error: learner.{field}: "), lines[0]
    assert message in lines[0], lines[0]
    assert captured.out == ""


def test_a_good_spec_prints_the_config(capsys):
    argv = ["train", "--preset", "gpt-tiny", "--print-config"]
    argv += ["--set", "learner.optimizer=muon:ns_steps=3"]
    argv += ["--set", "learner.schedule=wsd:decay_fraction=0.1,shape=sqrt"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "muon:ns_steps=3" in out and "wsd:decay_fraction=0.1,shape=sqrt" in out


def test_the_page_the_cores_unknown_name_error_points_to_names_this_plugin():
    from pathlib import Path

    page = Path(__file__).resolve().parents[3] / "docs" / "plugin-reference.md"
    if not page.exists():
        pytest.skip("outside the axplug repository")
    for kind, names in (("optimizers", OPTIMIZERS), ("schedules", SCHEDULES)):
        section = page.read_text().split(f"### `axplug.{kind}`\n")[1].split("\n### ")[0]
        assert "axplug-optimizers" in section, kind
        for name in names:
            assert f"`{name}`" in section, name


def test_list_names_this_distribution(capsys):
    for kind, names in (("optimizers", OPTIMIZERS), ("schedules", SCHEDULES)):
        assert main(["list", "--kind", kind]) == 0
        rows = capsys.readouterr().out.splitlines()
        for name in names:
            assert any(r.startswith("axplug-optimizers ") and f" {name} " in r for r in rows), name


# ------------------------------------------------------------------------------- training


def test_train_with_lion_and_wsd_logs_the_schedule(tmp_path):
    run = tmp_path / "run"
    peak, warmup, steps = 1e-3, 1, 6
    args = tiny_train_args(
        run, "learner.optimizer=lion", "learner.schedule=wsd:decay_fraction=0.4",
        f"learner.learning_rate={peak}", f"learner.warmup_steps={warmup}", "log_every=1",
        max_steps=steps,
    )  # fmt: skip
    assert main([*args, "--mesh-rule", "none", "-q"]) == 0
    rows = [json.loads(line) for line in (run / "metrics.jsonl").open()]
    logged = {r["step"]: r["learning_rate"] for r in rows if "learning_rate" in r}
    assert sorted(logged) == list(range(1, steps + 1))
    # Step n trains with the rate at n - 1: warmup from 0, then 5 steps: 3 at the peak and a
    # linear decay over the last round(5 * 0.4) = 2 to a tenth of it.
    decay, stable, end = 2, 3, peak * 0.1

    def wsd(t):
        if t < warmup:
            return peak * t / warmup
        p = min(max((t - warmup - stable) / decay, 0.0), 1.0)
        return end + (peak - end) * (1 - p)

    expected = [wsd(n - 1) for n in sorted(logged)]
    np.testing.assert_allclose([logged[n] for n in sorted(logged)], expected, rtol=1e-5)
    assert expected[1:5] == [peak] * 4 and expected[5] < peak  # plateau, then the decay
    assert all(math.isfinite(r["loss"]) for r in rows if "loss" in r)


@pytest.mark.parametrize("optimizer", ["muon", "adafactor"])
def test_the_trainer_lays_out_partitioned_and_factored_state(tmp_path, optimizer):
    """muon's state is partitioned (MaskedNode leaves), adafactor's moments factored."""
    cfg = tiny_trainer_config(tmp_path, f"learner.optimizer={optimizer!r}", max_steps=2)
    trainer = cfg.instantiate()
    metrics = trainer.run()
    assert np.isfinite(metrics["loss"])
