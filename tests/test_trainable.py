"""`learner.trainable`: frozen parameters get no gradient, no optimizer state and never change."""

import jax
import numpy as np
import pytest
from axplug_testing import tiny_trainer_config

from axplug.config import ConfigError
from axplug.trainer import Trainer
from axplug.trainer.trainable import parameter_paths


def _run(tmp_path, name, *overrides, steps=3):
    cfg = tiny_trainer_config(tmp_path / name, *overrides, preset="llama-tiny", max_steps=steps)
    trainer = cfg.instantiate()
    state = trainer.init_state()
    first = jax.device_get(state["params"])
    for step in range(steps):
        state, metrics = trainer._train_step(state, trainer.put_batch(trainer.input.batch(step)))
    return trainer, first, state, metrics


def test_frozen_parameters_do_not_change_and_have_no_optimizer_state(tmp_path):
    trainer, first, state, metrics = _run(tmp_path, "q", "learner.trainable='qkv/q/weight$'")
    paths = jax.tree.leaves(parameter_paths(first))
    before, after = jax.tree.leaves(first), jax.tree.leaves(jax.device_get(state["params"]))
    trained = [p for p in paths if p.endswith("qkv/q/weight")]
    assert trained and len(trained) < len(paths)
    for path, old, new in zip(paths, before, after, strict=True):
        if path in trained:
            assert not np.array_equal(old, new), path
        else:
            assert np.array_equal(old, new), path  # bit-identical
    # Adam's two moments exist for the trained weights only.
    moments = sum(x.size for x in jax.tree.leaves(state["opt_state"]) if x.ndim > 0)
    assert moments == 2 * sum(x.size for p, x in zip(paths, before, strict=True) if p in trained)
    assert np.isfinite(float(metrics["loss"]))


def test_trained_parameters_follow_the_same_updates_as_a_full_run_with_frozen_gradients(tmp_path):
    """With SGD (no clipping, no decay), a trained leaf moves exactly as in a full run: the
    frozen leaves change the forward pass only through their (unchanged) values."""
    sgd = ("learner.optimizer='sgd'", "learner.momentum=0.0", "learner.weight_decay=0.0",
           "learner.max_grad_norm=None")  # fmt: skip
    _, _, frozen_state, _ = _run(tmp_path, "f", *sgd, "learner.trainable='qkv/q/'", steps=1)
    _, _, full_state, _ = _run(tmp_path, "a", *sgd, steps=1)
    frozen, full = jax.device_get(frozen_state["params"]), jax.device_get(full_state["params"])
    q = lambda p: p["decoder"]["transformer"]["layer0"]["attention"]["qkv"]["q"]["weight"]  # noqa: E731
    np.testing.assert_allclose(q(frozen), q(full), rtol=1e-6, atol=1e-7)


def test_a_pattern_that_matches_nothing_is_an_error_naming_the_field(tmp_path):
    cfg = tiny_trainer_config(tmp_path, "learner.trainable='no_such_weight'", preset="llama-tiny")
    with pytest.raises(ConfigError, match=r"learner\.trainable: 'no_such_weight' matches no"):
        Trainer(cfg)


def test_a_bad_regex_is_an_error_naming_the_field(tmp_path):
    cfg = tiny_trainer_config(tmp_path, "learner.trainable='q_proj['", preset="llama-tiny")
    with pytest.raises(ConfigError, match=r"learner\.trainable: 'q_proj\[' is not a regular"):
        Trainer(cfg)
