"""The Trainer: learning, meshes, aux losses, NaN guard, hooks and gradient accumulation.

Tolerances: runs on different meshes reduce in different orders, so losses agree to ~1e-5
relative (float32); identical programs on identical inputs must agree bit for bit.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from axplug_testing import production_compiler_options, tiny_trainer_config, train_steps

from axplug.api import hookimpl
from axplug.config import config_class, find_configs
from axplug.input import Input
from axplug.layers import CausalLM, FeedForward
from axplug.learner import Learner
from axplug.summary import read_jsonl
from axplug.trainer import AuxLossRule, NonFiniteError, Trainer, build_train_step


def tiny_config(tmp_path, *extra, steps=6):
    return tiny_trainer_config(
        tmp_path, "checkpoint_every=3", "log_every=1", *extra, max_steps=steps
    )


ALL = "mesh.mesh_shape=(-1, 1, 1, 1, 1)"  # every device (or those a test passes), not one


def losses(trainer_run_dir):
    return [r["loss"] for r in read_jsonl(trainer_run_dir / "metrics.jsonl") if "loss" in r]


def with_jsonl(cfg):
    from axplug.summary import JsonlWriter

    return cfg.clone(summary_writers=[JsonlWriter.default_config()])


def test_gpt_tiny_learns_and_checkpoints(tmp_path):
    cfg = with_jsonl(tiny_config(tmp_path, "learner.learning_rate=1e-2", steps=12))
    trainer = cfg.instantiate()
    final = trainer.run()
    values = losses(tmp_path)
    assert len(values) == 12 and final["step"] == 12
    assert values[-1] < values[0] - 0.5, values  # bytes: from ~ln(256) toward the corpus entropy
    assert trainer.checkpointer.all_steps() == [6, 9, 12]
    assert int(trainer.state["step"]) == 12


def mesh_config(tmp_path, preset, *extra, steps=3):
    """`preset` trained as other tests train it on one device and on meshes, so that each
    program compiles once a session: llama-tiny as tests/test_sharding.py's layouts (2 layers,
    8 rows of 64 tokens), gpt-tiny as the kit's (and tests/test_golden_losses.py's fsdp)."""
    if preset == "llama-tiny":
        layouts = ("model.decoder.transformer.num_layers=2", "input.seq_len=64")
        extra = (*layouts, "input.batch_size=8", *extra)
    return tiny_trainer_config(tmp_path, *extra, preset=preset, max_steps=steps)


@pytest.fixture(scope="module")
def one_device_steps(tmp_path_factory):
    """preset -> (losses, parameters) of 3 steps on one device, and its initial state: the
    meshes' reference (and gpt-tiny's, the kit's model, for the tests that start from it)."""

    @functools.cache
    def steps(preset):
        one = mesh_config(tmp_path_factory.mktemp("one"), preset)  # the kit's one-device mesh
        trainer = one.instantiate()
        initial = jax.device_get(trainer.init_state())
        state, metrics = train_steps(trainer, 3, state=initial)
        return [m["loss"] for m in metrics], jax.device_get(state["params"]), initial

    return steps


@pytest.mark.parametrize(
    "preset, mesh_shape",
    [
        ("llama-tiny", (8, 1, 1, 1, 1)),
        ("gpt-tiny", (1, 8, 1, 1, 1)),
        ("gpt-tiny", (2, 1, 1, 1, 4)),
    ],
    ids=["data", "fsdp", "data+model"],
)
def test_mesh_steps_match_one_device(tmp_path, preset, mesh_shape, one_device_steps):
    want_losses, want_params, initial = one_device_steps(preset)
    many = mesh_config(tmp_path, preset, f"mesh.mesh_shape={mesh_shape}").instantiate()
    assert many.mesh.devices.size == 8
    # From the one device's initial state, laid out on the mesh (an init program per mesh
    # is a compile of its own): the steps are the claim. data+model draws its own, so
    # initialization on a mesh stays checked too (as tests/test_sharding.py's fsdp+seq+model).
    own_init = mesh_shape == (2, 1, 1, 1, 4)
    state, metrics = train_steps(many, 3, state=None if own_init else initial)
    np.testing.assert_allclose([m["loss"] for m in metrics], want_losses, rtol=2e-5)
    # Parameters really are laid out over the mesh.
    emb = state["params"]["decoder"]["embedding"]["weight"]
    assert len(emb.sharding.device_set) == 8
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6),
        jax.device_get(state["params"]),
        want_params,
    )


class AuxLM(CausalLM):
    """A CausalLM that emits an aux loss c * sum(w^2) from every feed-forward."""


class PenalizedFeedForward(FeedForward):
    @config_class
    class Config(FeedForward.Config):
        coefficient: float = 0.5

    def forward(self, x):
        w = self.parameters["wo"]["weight"]
        self.add_module_output("penalty_loss", self._config.coefficient * jnp.sum(w * w))
        self.add_module_output("not_a_loss_stat", jnp.ones(()))
        return super().forward(x)


@pytest.mark.parametrize("scan", [False, True], ids=["stacked", "repeated"])
def test_aux_losses_reach_the_loss_and_the_gradient(tmp_path, scan, one_device_steps):
    from axplug.config import replace_config

    cfg = tiny_config(tmp_path, "model.decoder.transformer.num_layers=2")
    if scan:
        from axplug.modifiers import make_modifier

        cfg = make_modifier("scan_layers")(cfg)
    cfg = replace_config(cfg, target=FeedForward, new_cfg=PenalizedFeedForward.default_config())
    trainer = cfg.instantiate()
    # Stacked, the penalized feed-forwards hold the kit's parameters: its initial state (the
    # meshes' reference), not an init of their own. Scanned layers stack them: their own.
    state = trainer.init_state() if scan else one_device_steps("gpt-tiny")[2]
    batch = trainer.put_batch(trainer.input.batch(0))
    step = build_train_step(trainer.model, optax.sgd(0.0), trainer.aux_loss, seed=0)
    _, metrics = jax.jit(step)(state, batch)
    params = jax.device_get(state["params"]["decoder"]["transformer"])  # numpy: no op programs
    if scan:
        expected = 0.5 * np.sum(params["layer"]["feed_forward"]["wo"]["weight"] ** 2)
    else:
        expected = sum(
            0.5 * np.sum(params[f"layer{i}"]["feed_forward"]["wo"]["weight"] ** 2) for i in range(2)
        )
    np.testing.assert_allclose(metrics["penalty_loss"], expected, rtol=1e-5)
    np.testing.assert_allclose(metrics["loss"], metrics["ce_loss"] + expected, rtol=1e-5)
    assert "not_a_loss_stat" not in metrics
    # The gradient of the total loss includes the penalty: 2 * c * w on top of the CE part.
    rule_off = AuxLossRule.default_config().set(weights={"penalty_loss": 0.0}).instantiate()

    def grads(rule):
        from axplug.trainer.step import loss_fn, step_key

        fn = loss_fn(trainer.model, rule)
        loss = lambda p: fn(p, batch, step_key(0, state["step"]))[0]  # noqa: E731
        return jax.grad(loss)

    # One program for both gradients, not one per op (nor one per rule).
    both = jax.jit(lambda p: (grads(trainer.aux_loss)(p), grads(rule_off)(p)))
    g_on, g_off = jax.device_get(both(state["params"]))
    path = ("layer", "feed_forward", "wo") if scan else ("layer0", "feed_forward", "wo")
    pick = lambda g: g["decoder"]["transformer"][path[0]][path[1]][path[2]]["weight"]  # noqa: E731
    w = params[path[0]][path[1]][path[2]]["weight"]
    np.testing.assert_allclose(pick(g_on) - pick(g_off), 2 * 0.5 * w, rtol=1e-4, atol=1e-6)


class Poisoned(CausalLM):
    """Emits a NaN aux loss when the first input token is 255."""

    def forward(self, input_ids, target_labels, **kw):
        poison = jnp.where(input_ids[0, 0] == 255, jnp.nan, 0.0)
        self.add_module_output("poison_loss", poison)
        return super().forward(input_ids, target_labels, **kw)


class PoisonInput(Input):
    """Wraps an input so the batches of `bad_steps` start with token 255."""

    def __init__(self, inner, bad_steps):
        self.inner, self.bad_steps = inner, set(bad_steps)

    def iter_from(self, step):
        while True:
            yield step, self.batch(step)
            step += 1

    def batch(self, step):
        batch = dict(self.inner.batch(step))
        ids = np.array(batch["input_ids"]) % 200
        if step in self.bad_steps:
            ids[0, 0] = 255
        batch["input_ids"] = ids
        return batch


def poisoned_trainer(tmp_path, bad_steps, extra=(), **kw):
    cfg = tiny_config(tmp_path, *extra, **kw)
    decoder = cfg.model.decoder
    cfg.model = Poisoned.default_config().set(decoder=decoder)
    trainer = with_jsonl(cfg).instantiate()
    trainer.input = PoisonInput(trainer.input, bad_steps)
    return trainer


def test_nonfinite_step_is_skipped_and_reported(tmp_path, caplog, one_device_steps):
    trainer = poisoned_trainer(tmp_path, bad_steps=[0], steps=1)
    # The run's initial state: Poisoned adds no parameter to the kit's model and learner, so
    # they are gpt-tiny's (the meshes' reference), not an init of their own.
    initial = one_device_steps("gpt-tiny")[2]
    trainer.run()
    assert "step 1: non-finite loss or gradient" in caplog.text
    after = jax.device_get(trainer.state)
    jax.tree.map(np.testing.assert_array_equal, after["params"], initial["params"])
    jax.tree.map(np.testing.assert_array_equal, after["opt_state"], initial["opt_state"])
    assert int(after["step"]) == 1  # the data moves on past the bad batch


def test_both_guards_skip_a_bad_step_and_apply_good_ones_alike(tmp_path):
    # Steps 0 and 2 are good, step 1 is poisoned: the select guard (accelerators' default)
    # must leave exactly what the branch (CPU's default) leaves, bit for bit.
    # The claim is about the compiler users run: the session's fast-compile flags fuse the two
    # programs differently. One layer: optimized compiles of the two programs are the cost,
    # and the guards wrap the whole update whatever the depth.
    def trainer(name):
        extra = (f"guard.mode={name!r}", "model.decoder.transformer.num_layers=1")
        return poisoned_trainer(tmp_path / name, bad_steps=[1], steps=3, extra=extra)

    cond, select = trainer("cond"), trainer("select")
    initial = jax.device_get(cond.init_state())  # one model and seed: both start from it

    def run(trainer):
        options = production_compiler_options()
        state, _ = train_steps(trainer, 3, state=initial, compiler_options=options)
        return jax.device_get(state)

    want, got = run(cond), run(select)
    jax.tree.map(np.testing.assert_array_equal, got, want)


def test_the_guard_is_chosen_per_platform_and_checked():
    from axplug.config import ConfigError
    from axplug.trainer.step import guard_for

    assert guard_for("cpu") == "cond"
    assert guard_for("gpu") == guard_for("tpu") == "select"
    assert guard_for("gpu", "cond") == "cond" and guard_for("cpu", "select") == "select"
    with pytest.raises(ConfigError, match="guard.mode: must be one of"):
        tiny_config("unused", "guard.mode='maybe'").instantiate()


def test_an_input_that_is_not_an_input_is_refused_by_its_path(tmp_path):
    from axplug.config import ConfigError

    cfg = tiny_config(tmp_path)
    cfg.eval_input = Learner.default_config()  # a configurable, not an Input
    with pytest.raises(ConfigError, match=r"eval_input: .*Learner.* is not a subclass of axplug"):
        Trainer.check_config(cfg)


def test_consecutive_nonfinite_steps_stop_the_run_with_finite_checkpoints(tmp_path):
    trainer = poisoned_trainer(tmp_path, bad_steps=[3, 4, 5], steps=6)
    with pytest.raises(NonFiniteError, match="stopping at step 6: 3 consecutive steps"):
        trainer.run()
    assert trainer.checkpointer.all_steps() == [3]  # nothing is saved past the bad steps
    _, state, _ = trainer.checkpointer.restore(3, target=trainer.layout.abstract)
    assert all(np.isfinite(x).all() for x in jax.tree.leaves(jax.device_get(state["params"])))


class Recorder:
    def __init__(self):
        self.events = []

    @hookimpl
    def on_train_start(self, trainer):
        self.events.append(("start", None))

    @hookimpl
    def on_step_end(self, trainer, step, metrics):
        self.events.append(("step", step, metrics["loss"]))

    @hookimpl
    def on_checkpoint_saved(self, trainer, step, path):
        self.events.append(("checkpoint", step, path))

    @hookimpl
    def on_train_end(self, trainer, metrics):
        self.events.append(("end", metrics["step"]))


class Exploding:
    @hookimpl
    def on_step_end(self, trainer, step, metrics):
        raise RuntimeError("hook bug")


def test_hooks_given_and_from_an_entry_point_are_called_and_a_raising_one_does_not_kill_the_run(
    tmp_path, plugin_site
):
    """Hooks the caller gives and a plugin's (an `axplug.hooks` entry point), in one run."""
    source = (
        "from axplug.api import hookimpl\n"
        "CALLS = []\n"
        "@hookimpl\n"
        "def on_train_end(trainer, metrics):\n"
        "    CALLS.append(metrics['step'])\n"
    )
    plugin_site.add(
        "fake-hooks",
        {"axplug.hooks": {"rec": "fake_rec_hooks"}},
        modules={"fake_rec_hooks": source},
    )
    recorder = Recorder()
    trainer = tiny_config(tmp_path, steps=3).instantiate(hooks=(recorder, Exploding()))
    trainer.run()
    kinds = [e[0] for e in recorder.events]
    assert kinds == ["start", "step", "step", "step", "checkpoint", "end"]
    assert [e[1] for e in recorder.events if e[0] == "step"] == [1, 2, 3]
    assert recorder.events[4][2].endswith("checkpoints/step_00000003")
    # Called once: "the run continues without it" means what it says.
    assert len(trainer.hooks.failures) == 1
    assert "hook on_step_end of plugin" in trainer.hooks.failures[0]
    assert "RuntimeError: hook bug" in trainer.hooks.failures[0]
    import fake_rec_hooks

    assert fake_rec_hooks.CALLS == [3]


def test_gradient_accumulation_matches_the_full_batch(tmp_path, one_device_steps):
    trainer = tiny_config(tmp_path).instantiate()
    state = one_device_steps("gpt-tiny")[2]  # this model's initial state: no init of its own
    batch = trainer.input.batch(0)
    tx = optax.sgd(1.0)
    results = []
    for k in (1, 4):  # k > 1 is one scan over k microbatches: 4 shows what 2 would
        step = build_train_step(
            trainer.model, tx, trainer.aux_loss, seed=0, grad_accumulation_steps=k
        )
        new_state, metrics = jax.jit(step)(state, batch)
        results.append((new_state["params"], metrics["loss"]))
    for params, loss in results[1:]:
        np.testing.assert_allclose(loss, results[0][1], rtol=1e-5)
        jax.tree.map(
            lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6),
            params,
            results[0][0],
        )


def test_learner_schedule_and_weight_decay_mask():
    learner = (
        Learner.default_config()
        .set(learning_rate=1.0, warmup_steps=10, schedule="cosine", end_learning_rate_fraction=0.1)
        .instantiate()
    )
    lr = jax.jit(learner.schedule(110))  # one program, not one per op
    np.testing.assert_allclose([lr(0), lr(5), lr(10)], [0.0, 0.5, 1.0], atol=1e-6)
    # Cosine from 1.0 to 0.1 over the 100 steps after warmup.
    np.testing.assert_allclose(lr(60), 0.1 + 0.9 * 0.5 * (1 + np.cos(np.pi * 0.5)), rtol=1e-5)
    np.testing.assert_allclose(lr(110), 0.1, rtol=1e-5)
    linear = Learner.default_config().set(learning_rate=2.0, schedule="linear").instantiate()
    linear_lr = jax.jit(linear.schedule(100))
    np.testing.assert_allclose(linear_lr(50), 2.0 - 0.5 * (2.0 - 0.2), rtol=1e-5)

    from axplug.api import ParameterSpec

    ones = jax.nn.initializers.ones
    specs = {
        "norm": ParameterSpec((4,), jnp.float32, ("embed",), ones, weight_decay_scale=0.0),
        "w": ParameterSpec((4,), jnp.float32, ("embed",), ones),
    }
    params = {"norm": np.ones(4, np.float32), "w": np.ones(4, np.float32)}
    for optimizer in ("adamw", "sgd"):
        tx = (
            Learner.default_config()
            .set(
                optimizer=optimizer,
                learning_rate=1.0,
                weight_decay=0.5,
                max_grad_norm=None,
                schedule="constant",
            )
            .instantiate()
            .transform(specs, 10)
        )
        zero = jax.tree.map(np.zeros_like, params)
        updates, _ = jax.jit(lambda p, z, tx=tx: tx.update(z, tx.init(p), p))(params, zero)
        # With zero gradients only weight decay moves a parameter: the masked one stays put.
        np.testing.assert_array_equal(updates["norm"], 0.0)
        assert np.all(np.abs(updates["w"]) > 0), optimizer
    with pytest.raises(Exception, match="learner.optimizer: unknown 'lionx'"):
        Learner.default_config().set(optimizer="lionx").instantiate()


def test_weight_decay_skips_norm_scales_in_a_real_step(tmp_path, one_device_steps):
    cfg = tiny_config(
        tmp_path,
        "learner.learning_rate=0.1",
        "learner.weight_decay=0.5",
        "learner.schedule='constant'",
        "learner.max_grad_norm=None",
        "learner.warmup_steps=0",
    )
    trainer = cfg.instantiate()
    tx = trainer.learner.transform(trainer.param_specs, 10)
    # The same model's parameters as the kit's trainer draws them (the meshes' reference), not
    # an init of this learner's (whose optimizer state the test never reads).
    params = one_device_steps("gpt-tiny")[2]["params"]

    @jax.jit  # one program, not one per op and shape
    def first_update(params):
        zero = jax.tree.map(jnp.zeros_like, params)
        return tx.update(zero, tx.init(params), params)[0]

    updates = first_update(params)
    layer = updates["decoder"]["transformer"]["layer0"]
    np.testing.assert_array_equal(layer["attention_norm"]["scale"], 0.0)
    w = params["decoder"]["transformer"]["layer0"]["feed_forward"]["wo"]["weight"]
    np.testing.assert_allclose(layer["feed_forward"]["wo"]["weight"], -0.1 * 0.5 * w, rtol=1e-5)


def test_init_state_draws_what_the_keys_folded_in_the_program_draw(tmp_path):
    # The Trainer derives the keys op by op before its init program; a seed still means the
    # parameters that one program of `initialize_parameters_recursively` draws, bit for bit.
    trainer = tiny_trainer_config(tmp_path, "seed=7", preset="llama-tiny").instantiate()
    want = jax.jit(trainer.model.initialize_parameters_recursively)(jax.random.PRNGKey(7))
    got = trainer.init_state()["params"]
    assert len(jax.tree.leaves(got)) > 10
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(got), jax.device_get(want))
    keys = trainer.model.parameter_keys(jax.random.PRNGKey(7))
    assert jax.tree.structure(keys) == jax.tree.structure(got)


def test_trainer_is_config_built_and_errors_name_paths(tmp_path):
    cfg = Trainer.default_config()
    from axplug.config import RequiredFieldError

    with pytest.raises(RequiredFieldError, match="^output_dir: required"):
        cfg.instantiate()
    bad = tiny_config(tmp_path, "mesh.mesh_shape=(3, 2, 1, 1, 2)")
    with pytest.raises(Exception, match=r"mesh_shape \(3, 2, 1, 1, 2\) needs 12 devices but 8"):
        bad.instantiate()
    # A whole shape that needs fewer devices than the host has takes the first ones.
    two = tiny_config(tmp_path, "mesh.mesh_shape=(2, 1, 1, 1, 1)").instantiate()
    assert list(two.mesh.devices.flat) == jax.devices()[:2]


def test_batch_that_does_not_split_over_the_batch_axes_names_the_field(tmp_path):
    from axplug.config import ConfigError

    with pytest.raises(ConfigError, match=r"^input.batch_size: 4 rows .* 8 devices .*'data'"):
        tiny_config(tmp_path, "input.batch_size=4", ALL).instantiate()
    tiny_config(tmp_path, "input.batch_size=4", "mesh.mesh_shape=(4, 1, 1, 1, 1)").instantiate(
        devices=jax.devices()[:4]
    )


def test_summaries_of_a_bucket_run_go_to_a_local_mirror(tmp_path, monkeypatch):
    from axplug.trainer import summary_dir

    assert summary_dir(str(tmp_path)) == str(tmp_path)
    monkeypatch.delenv("AXPLUG_CACHE")
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    mirror = summary_dir("s3://bucket/runs/a/")
    assert mirror == str(tmp_path / "home/.cache/axplug/runs/s3/bucket/runs/a")
    monkeypatch.setenv("AXPLUG_CACHE", str(tmp_path / "cache"))  # the session's, in tests
    assert summary_dir("s3://bucket/runs/a/") == str(tmp_path / "cache/runs/s3/bucket/runs/a")


def test_resume_onto_a_different_mesh(tmp_path):
    one = mesh_config(tmp_path, "llama-tiny", "mesh.mesh_shape=(1, 1, 1, 1, 1)")
    saved = one.instantiate(devices=jax.devices()[:1])
    saved.run()
    fsdp = mesh_config(tmp_path, "llama-tiny", "mesh.mesh_shape=(1, 8, 1, 1, 1)")
    restored = fsdp.instantiate().restore_or_init()
    assert int(restored["step"]) == 3
    emb = restored["params"]["decoder"]["embedding"]["weight"]
    assert emb.sharding.spec == jax.sharding.PartitionSpec(None, "fsdp")
    jax.tree.map(
        np.testing.assert_array_equal, jax.device_get(restored), jax.device_get(saved.state)
    )


def test_eval_runs_on_the_held_out_split(tmp_path):
    from axplug.input import ByteTextInput

    # One save, at the end: the run's checkpoints are not what it is for.
    settings = ("eval_every=2", "eval_batches=2", "checkpoint_every=4")
    cfg = with_jsonl(tiny_config(tmp_path, *settings, steps=4))
    cfg.eval_input = ByteTextInput.default_config().set(split="eval", seq_len=32, batch_size=8)
    trainer = cfg.instantiate()
    trainer.run()
    evals = [r for r in read_jsonl(tmp_path / "metrics.jsonl") if "eval_loss" in r]
    assert [r["step"] for r in evals] == [2, 4]
    assert all(0 < r["eval_loss"] < 10 for r in evals)


class Monitor:
    """A device-utilization reader (12.5% busy) that records the low-utilization calls."""

    def __init__(self):
        self.low, self.asked = [], []

    @hookimpl
    def device_utilization(self, devices):
        self.asked.append(len(devices))
        return 12.5

    @hookimpl
    def on_low_utilization(self, trainer, step, metric, value, threshold):
        self.low.append((step, metric, value, threshold))


@pytest.fixture(scope="module")
def low_utilization_run(tmp_path_factory):
    """(config, trainer, monitor, run dir) of 4 steps on 2 devices with a fake device peak so
    large that MFU is ~0: every 2-step window is below min_mfu. One run for the MFU metrics
    and the low-utilization hooks."""
    run_dir = tmp_path_factory.mktemp("mfu")
    settings = [
        "peak_flops_per_device=1e30",
        "watchdog.min_mfu=0.5",
        "watchdog.min_device_busy_percent=50.0",
        "watchdog.utilization_window=2",
    ]
    monitor = Monitor()
    # One checkpoint, at the end: the run's saves are not what it is for.
    cfg = with_jsonl(tiny_config(run_dir, *settings, ALL, "checkpoint_every=4", steps=4))
    trainer = cfg.instantiate(devices=jax.devices()[:2], hooks=(monitor,))
    trainer.run()
    return cfg, trainer, monitor, run_dir


def test_metrics_carry_mfu_when_the_device_peak_is_known(low_utilization_run, gpt_tiny_trained):
    from axplug.trainer import model_flops_per_step

    cfg, trainer, _, run_dir = low_utilization_run
    peak = cfg.peak_flops_per_device  # a fake device spec's FLOP/s: CPUs have none
    rows = [r for r in read_jsonl(run_dir / "metrics.jsonl") if "mfu" in r]
    assert rows, "no step logged an MFU"
    flops = model_flops_per_step(cfg, trainer.model)
    for r in rows:
        assert r["model_flops_per_sec"] == pytest.approx(flops / r["step_time"])
        # Scaled by the 2 devices' peak: the MFU itself is ~1e-21, below approx's abs floor.
        assert r["mfu"] * (2 * peak) == pytest.approx(r["model_flops_per_sec"])
    # Without a device spec (CPU) there is no MFU to log: the session's shared run.
    plain = read_jsonl(gpt_tiny_trained / "metrics.jsonl")
    assert plain and not any("mfu" in r for r in plain)


def test_low_utilization_reaches_the_hooks_from_mfu_and_a_device_reader(low_utilization_run):
    _, trainer, monitor, _ = low_utilization_run
    assert monitor.asked == [2, 2]  # the local devices, once per window
    flagged = [(step, metric) for step, metric, _, _ in monitor.low]
    assert flagged == [(2, "mfu"), (2, "device_busy"), (4, "mfu"), (4, "device_busy")]
    assert all(value < 1e-6 for _, m, value, _ in monitor.low if m == "mfu")
    assert trainer.watchdog.low_utilization == monitor.low


def test_clipping_takes_the_norm_the_step_already_computed():
    from axplug.learner import clip_by_global_norm

    grads = {"a": np.array([3.0, 4.0], np.float32), "b": np.array([[12.0]], np.float32)}  # norm 13
    ours, theirs = clip_by_global_norm(6.5), optax.clip_by_global_norm(6.5)
    state = ours.init(grads)
    assert jax.tree.structure(state) == jax.tree.structure(theirs.init(grads))  # checkpoints
    # Each update one program, not one per op.
    want, _ = jax.jit(lambda g: theirs.update(g, theirs.init(g), None))(grads)
    clip = jax.jit(lambda g, norm: ours.update(g, state, None, grad_norm=norm)[0])
    for given in (None, jax.jit(optax.tree_utils.tree_norm)(grads)):
        got = clip(grads, given)
        jax.tree.map(np.testing.assert_array_equal, got, want)
    np.testing.assert_array_equal(want["b"], [[6.0]])  # halved: 13 -> 6.5
    small = clip(grads, np.float32(1.0))  # under the max
    jax.tree.map(np.testing.assert_array_equal, small, grads)


def test_train_step_reads_the_gradients_for_one_global_norm(tmp_path):
    cfg = tiny_config(tmp_path, "learner.optimizer='sgd'", "learner.max_grad_norm=1.0")
    trainer = cfg.instantiate()
    state, batch = (
        trainer.layout.abstract,
        {k: jax.ShapeDtypeStruct((8, 32), jnp.int32) for k in ("input_ids", "target_labels")},
    )

    def sqrts(jaxpr) -> int:
        n = 0
        for eqn in jaxpr.eqns:
            n += eqn.primitive.name == "sqrt"
            for param in eqn.params.values():  # nested jaxprs: jit, cond branches, scan bodies
                for sub in param if isinstance(param, tuple | list) else [param]:
                    if hasattr(sub, "jaxpr") and hasattr(sub.jaxpr, "eqns"):
                        n += sqrts(sub.jaxpr)
                    elif hasattr(sub, "eqns"):
                        n += sqrts(sub)
        return n

    # SGD takes no square roots: the one left is the global norm's (two before: the NaN
    # guard's and clip_by_global_norm's own, which XLA cannot merge across the cond).
    assert sqrts(jax.make_jaxpr(trainer._train_step)(state, batch).jaxpr) == 1


def test_max_steps_below_one_is_refused_naming_the_field(tmp_path):
    from axplug.config import ConfigValueError

    with pytest.raises(ConfigValueError, match=r"max_steps: must be >= 1, got -5"):
        tiny_config(tmp_path, steps=-5).instantiate()


def test_progress_moves_every_step_while_files_log_every_log_every(tmp_path, capsys):
    from axplug.summary import JsonlWriter, ProgressBar

    # One save, at the end: the run's checkpoints are not what it is for.
    cfg = tiny_config(tmp_path, "log_every=3", "checkpoint_every=4", steps=4).clone(
        summary_writers=[
            ProgressBar.default_config().set(terminal=False, every_n_steps=1),
            JsonlWriter.default_config(),
        ]
    )
    cfg.instantiate().run()
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("step ")]
    assert [line.split()[1] for line in lines] == ["1/4", "2/4", "3/4", "4/4"]
    assert [r["step"] for r in read_jsonl(tmp_path / "metrics.jsonl")] == [3, 4]


def test_layer_summaries_reach_the_metrics(tmp_path):
    pytest.importorskip("axplug_moe")
    from axplug.summary import JsonlWriter

    def run(name, *overrides, modifiers=(), capacity_factor=None):
        out = tmp_path / name
        cfg = tiny_trainer_config(
            out, *overrides, preset="moe-tiny", modifiers=modifiers, max_steps=1,
            summary_writers=[JsonlWriter.default_config()],
        )  # fmt: skip
        if capacity_factor is not None:
            for _, router in find_configs(cfg, "axplug_moe.router:TopKRouter"):
                router.capacity_factor = capacity_factor
        cfg.instantiate(devices=jax.devices()[:1]).run()
        return read_jsonl(out / "metrics.jsonl")[0]

    prefix = "moe"  # the router's group: every router's values, averaged
    # Each run's programs are another test's: drop-free, plugins/ffn_moe's test_dropless.py
    # (one layer); a quarter of the room, plugins/summary_tensorboard's writer test.
    drop_free = "moe:num_experts=8,top_k=2,capacity_factor=None"
    roomy = run("roomy", "model.decoder.transformer.num_layers=1", modifiers=[drop_free])
    tight = run("tight", "model.decoder.transformer.num_layers=2", "input.seq_len=16",
                capacity_factor=0.25)  # fmt: skip
    assert roomy[f"{prefix}/dropped_fraction"] == 0.0  # drop-free routing drops nothing
    assert tight[f"{prefix}/dropped_fraction"] >= 0.5  # a quarter of the room: most dropped
    for record in (roomy, tight):
        experts = 8
        assert record[f"{prefix}/expert_load"] == pytest.approx(1 / experts)  # loads sum to 1
        assert record[f"{prefix}/expert_load/max"] >= 1 / experts


def test_the_trainers_moved_fields_load_from_old_configs_and_name_their_new_paths(caplog):
    """The parts own their settings (restore, saving, guard, profile): a config saved before
    the move still loads, into the new places, with one warning; setting an old path fails
    naming the new one."""
    from axplug.config import UnknownFieldError, apply_overrides, from_dict, to_dict

    cfg = tiny_config("unused")
    old = {k: v for k, v in to_dict(cfg).items() if k not in ("restore", "saving", "guard")}
    old |= {
        "init_from": "runs/a",
        "init_step": 3,
        "on_corrupt_checkpoint": "stop",
        "on_save_error": "retry_next",
        "max_nonfinite_steps": 5,
        "nonfinite_guard": "select",
    }
    loaded = from_dict(old)
    assert (loaded.restore.init_from, loaded.restore.init_step) == ("runs/a", 3)
    assert (loaded.restore.on_corrupt, loaded.saving.on_error) == ("stop", "retry_next")
    assert (loaded.guard.max_steps, loaded.guard.mode) == (5, "select")
    warnings = [r.getMessage() for r in caplog.records if "saved before" in r.getMessage()]
    assert len(warnings) == 1 and "on_save_error -> saving.on_error" in warnings[0], warnings
    with pytest.raises(UnknownFieldError, match="^init_from: unknown field; it moved to restore"):
        apply_overrides(cfg, ["init_from='runs/a'"])
    with pytest.raises(UnknownFieldError, match="profile_steps: unknown field; it moved to prof"):
        cfg.profile_steps = "1:2"
