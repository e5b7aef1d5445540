"""GRPO on rollouts from the trainer's own Engine: log-probability parity, exact resume, one
device equal to eight, LoRA, overlap, and the errors of a bad setup (learning a task:
tests/test_docs_rl.py, which runs docs/rl.md)."""

import json
import os
import signal

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from axplug_rl.rollouts import RolloutInput
from axplug_testing import tiny_trainer_config, train_steps

from axplug.api import hookimpl
from axplug.api.config import ConfigError, ConfigFileError
from axplug.api.data import Policy
from axplug.api.layers import functional
from axplug.api.run import Preempted

DIGIT = "regex:pattern='[0-9]'"


@pytest.fixture(scope="module")
def prompts(tmp_path_factory):
    path = tmp_path_factory.mktemp("rl") / "prompts.jsonl"
    with path.open("w") as f:
        for i in range(12):
            record = {"prompt": f"Q{i}: a digit, please. A:", "answer": str(i % 10)}
            f.write(json.dumps(record) + "\n")
    return str(path)


def _config(out, prompts, *overrides, modifiers=(), steps=2, **rollouts):
    # One layer: no claim here is about depth (the Engine's caches over layers are the core's
    # tests'); every program traces, lowers and compiles in about 3/4 the time of two.
    cfg = tiny_trainer_config(
        out, "learner.learning_rate=0.01", "model.decoder.transformer.num_layers=1",
        *overrides, modifiers=["grpo", *modifiers], max_steps=steps
    )  # fmt: skip
    options = dict(tokenizer="bytes", template="plain", batch_size=8, group_size=4, seq_len=40,
                   max_new_tokens=8, rewards=[DIGIT])  # fmt: skip
    cfg.input = RolloutInput.default_config().set(prompts=prompts, **{**options, **rollouts})
    return cfg


def _recomputed_logps(trainer, params, batch):
    """The trainer's log-probabilities of the batch's completion tokens: the model's forward
    (the one the loss differentiates), not the Engine; compiled as one program (op by op,
    every op of the forward would compile for its shape)."""

    @jax.jit
    def log_softmax(params, inputs):
        (_, outputs), _ = functional(
            trainer.model, prng_key=None, state=params, inputs=inputs, is_training=False
        )
        return jax.nn.log_softmax(outputs["logits"].astype(jnp.float32), axis=-1)

    logp = log_softmax(params, {k: jnp.asarray(v) for k, v in batch.items()})
    labels = np.maximum(batch["target_labels"], 0)
    return np.take_along_axis(np.asarray(logp), labels[..., None], axis=-1)[..., 0]


def _first_rollout(trainer, params):
    """The first batch the trainer's input decodes from `params`, and its rollout metrics."""
    trainer.input.before_batch(0, Policy(trainer.model, params, trainer.mesh,
                                         trainer.mesh_builder.axis_rules))  # fmt: skip
    return trainer.input.batch(0), trainer.input.metrics(0)


def _first_step(cfg):
    """(trainer, initial parameters, first batch, its rollout metrics, the parameters after
    the built train step's first call on that batch): the first step as a run takes it, its
    rollouts decoded from the initial parameters (no run: nothing is checkpointed)."""
    trainer = cfg.instantiate()
    state = trainer.init_state()
    params = jax.device_get(state["params"])  # the step donates the state's arrays
    batch, metrics = _first_rollout(trainer, state["params"])
    state, _ = train_steps(trainer, 1, state)  # on the batch decoded above, held for step 0
    return trainer, params, batch, metrics, jax.device_get(state["params"])


@pytest.fixture(scope="module")
def plain_first_step(tmp_path_factory, prompts):
    """`_first_step` of the plain trainer (one device, a contiguous cache, no adapters),
    shared by the Engine parity test, the one-device side of the eight-device test and (its
    input) the synchronous side of the overlap test."""
    return _first_step(_config(tmp_path_factory.mktemp("plain"), prompts, steps=1))


# A covering pair, not the four combinations: the plain trainer (a contiguous cache, no
# adapters) and a paged cache with adapters; each of the paged cache's prefix sharing and the
# adapters' share in both computations is checked (the rollouts input special-cases neither:
# the two are independent modifiers of the model).
@pytest.mark.parametrize(
    ("cache", "adapters"),
    [("contiguous", False), ("paged", True)],
    ids=["full-contiguous", "lora-paged"],
)
def test_engine_logps_equal_the_trainers_recomputation(request, tmp_path, prompts, cache,
                                                       adapters):  # fmt: skip
    if cache == "contiguous" and not adapters:
        trainer, params, batch, metrics, _ = request.getfixturevalue("plain_first_step")
    else:
        modifiers = (["paged_kv_cache:page_size=4"] if cache == "paged" else []) + (
            ["lora:4"] if adapters else []
        )
        trainer = _config(tmp_path, prompts, modifiers=modifiers).instantiate()
        params = trainer.init_state()["params"]
        if adapters:  # adapters that change the model, so they take part in both computations
            params = jax.tree_util.tree_map_with_path(
                lambda p, x: x + 0.05 if "lora_b" in jax.tree_util.keystr(p) else x, params
            )
        batch, metrics = _first_rollout(trainer, params)
    # A paged cache shares each prompt's full pages among its group's completions.
    hit_rate = metrics["rollout/prefix_hit_rate"]
    assert hit_rate > 0.5 if cache == "paged" else hit_rate == 0
    mask = batch["target_labels"] >= 0
    sampled = ~np.isnan(batch["behavior_logps"]) & mask
    assert sampled.sum() >= 8 * 4  # completions of several tokens were sampled
    recomputed = _recomputed_logps(trainer, params, batch)
    gap = np.abs(batch["behavior_logps"] - recomputed)[sampled]
    assert gap.max() < 1e-5, gap.max()


def _final_params(cfg):
    trainer = cfg.instantiate()
    trainer.run()
    return jax.device_get(trainer.state["params"])


class _SigtermAt:
    """Sends this process SIGTERM as `step` ends, as a scheduler would."""

    def __init__(self, step):
        self.step = step

    @hookimpl
    def on_step_end(self, trainer, step, metrics):
        if step == self.step:
            os.kill(os.getpid(), signal.SIGTERM)


def test_sigterm_mid_run_saves_and_the_rerun_reaches_the_same_parameters(tmp_path, prompts):
    """SIGTERM as step 2 ends stops the run after step 3, mid-way through a batch used for two
    updates (its rollouts are saved with the checkpoint): the rerun ends where an
    uninterrupted run ends, bit for bit."""
    options = dict(updates_per_rollout=2, reference=None)
    whole = _final_params(_config(tmp_path / "whole", prompts, steps=4, **options))
    cfg = _config(tmp_path / "split", prompts, steps=4, **options)
    with pytest.raises(Preempted) as info:
        cfg.instantiate(hooks=(_SigtermAt(2),)).run()
    assert info.value.step == 3  # the step in flight finishes: mid-way through a batch
    resumed = _final_params(cfg)
    for a, b in zip(jax.tree_util.tree_leaves(whole), jax.tree_util.tree_leaves(resumed),
                    strict=True):  # fmt: skip
        np.testing.assert_array_equal(a, b)


def test_eight_devices_train_as_one(tmp_path, prompts, plain_first_step):
    one = plain_first_step[-1]
    eight = _first_step(_config(tmp_path, prompts, modifiers=["mesh:fsdp=8"], steps=1))[-1]
    for a, b in zip(jax.tree_util.tree_leaves(one), jax.tree_util.tree_leaves(eight), strict=True):
        np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-6)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (dict(group_size=1), "group_size: must be >= 2 (a group is compared)"),
        (dict(batch_size=6), "batch_size: 6 must be a multiple of group_size=4"),
        (dict(max_new_tokens=50), "max_new_tokens: must be in [1, seq_len=40]"),
        (dict(reference="initial"), "reference: 'initial'; choose from"),
        (dict(rewards=["no_such_reward"]), "no_such_reward"),
    ],
)
def test_a_bad_rollouts_config_names_its_field(tmp_path, prompts, options, message):
    with pytest.raises((ConfigError, ValueError)) as info:
        _config(tmp_path, prompts, **options).instantiate()
    assert message in str(info.value)


def test_bad_prompt_files_name_the_file_and_line(tmp_path, prompts):
    missing = tmp_path / "missing.jsonl"
    with pytest.raises(ConfigFileError, match="missing.jsonl' does not exist"):
        _config(tmp_path, str(missing)).instantiate()
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "fine"}\n{"text": "no prompt"}\n')
    with pytest.raises(ConfigFileError, match=r"bad.jsonl:2: each line must be a JSON object"):
        _config(tmp_path, str(bad)).instantiate()
    long = tmp_path / "long.jsonl"
    long.write_text(json.dumps({"prompt": "x" * 40}) + "\n")
    with pytest.raises(ConfigFileError, match=r"long.jsonl:1: the prompt is 40 tokens, more than"):
        _config(tmp_path, str(long)).instantiate()


def test_the_policy_loss_without_rollouts_says_which_input_to_use(tmp_path):
    cfg = tiny_trainer_config(  # one layer, as `_config`'s: the same parameters' init program
        tmp_path, "model.decoder.transformer.num_layers=1", modifiers=["grpo"], max_steps=1
    )
    with pytest.raises(ConfigError, match="use --input rollouts:prompts=FILE"):
        cfg.instantiate().run()


def test_lora_grpo_with_a_kl_to_the_base_trains_only_the_adapters(tmp_path, prompts):
    cfg = _config(tmp_path, prompts, modifiers=["lora:4"], reference="adapters_off", steps=2)
    cfg.model.kl_beta = 0.05
    trainer = cfg.instantiate()
    start = jax.device_get(trainer.init_state()["params"])
    trainer.run()
    end = jax.device_get(trainer.state["params"])
    flat_start = dict(jax.tree_util.tree_leaves_with_path(start))
    changed = [
        jax.tree_util.keystr(path)
        for path, leaf in jax.tree_util.tree_leaves_with_path(end)
        if not np.array_equal(leaf, flat_start[path])
    ]
    assert changed and all("adapter" in path for path in changed), changed


def test_axplug_list_shows_the_rewards(capsys):
    from axplug_testing import cli_main as main

    assert main(["list", "--kind", "rewards"]) == 0
    out = capsys.readouterr().out
    assert all(name in out for name in ("exact_match", "regex", "math", "code")), out


def test_overlap_decodes_each_batch_from_the_parameters_the_step_before_started_from(
    tmp_path, prompts, plain_first_step
):
    """With overlap the batch of step 1 is decoded in a thread while step 0 trains, from the
    parameters step 0 started from: equal to a synchronous rollout of step 1 from those. A
    run with it (the train step donating its state meanwhile) trains, importance-corrected."""
    # An evaluation every step waits for the batch decoding ahead; the batch is kept.
    trainer = _config(tmp_path / "ahead", prompts, overlap=True, eval_prompts=prompts,
                      eval_every=1, eval_k=1).instantiate()  # fmt: skip
    rules = trainer.mesh_builder.axis_rules
    start = trainer.init_state()["params"]
    # As if step 0 had updated them (one program, not one per parameter shape).
    moved = jax.jit(lambda params: jax.tree.map(lambda x: x * 1.5, params))(start)
    ahead = trainer.input
    ahead.before_batch(0, Policy(trainer.model, start, trainer.mesh, rules))
    ahead.batch(0)
    ahead.before_batch(1, Policy(trainer.model, moved, trainer.mesh, rules))
    stale = ahead.batch(1)
    # The plain trainer's input: the same rollouts config, without overlap.
    sync = plain_first_step[0].input
    sync.before_batch(1, Policy(trainer.model, start, trainer.mesh, rules))
    expected = sync.batch(1)
    for name, value in expected.items():
        np.testing.assert_array_equal(stale[name], value, err_msg=name)

    cfg = _config(tmp_path / "run", prompts, modifiers=["grpo:tis_cap=2.0"], overlap=True,
                  steps=2)  # fmt: skip
    assert cfg.instantiate().run()["step"] == 2


def test_a_policy_model_folds_to_the_plain_causal_lm(tmp_path, prompts):
    """What export-hf writes: the same parameters as a plain CausalLM."""
    from axplug.api.layers import CausalLM, fold_layers

    cfg = _config(tmp_path, prompts).model
    params = {"decoder": {}}
    folded, same = fold_layers(cfg, params)
    assert folded.klass is CausalLM and folded.decoder == cfg.decoder and same == params
