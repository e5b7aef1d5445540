"""Pipeline parallelism: the same losses, gradients and checkpoints as the scanned stack."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from axplug_pipeline import bubble_fraction
from axplug_testing import tiny_trainer_config, train_steps

from axplug.api.config import ConfigError, replace_config
from axplug.api.layers import FeedForward, functional
from axplug.api.summary import read_jsonl

SMALL = [
    "log_every=1",
    "checkpoint_every=3",
    "model.decoder.dim=32",
    "model.decoder.transformer.num_layers=8",
    "model.decoder.transformer.layer.attention.num_heads=4",
    "model.decoder.transformer.layer.feed_forward.hidden_dim=64",
]


def llama8(tmp_path, *modifiers, steps=3):
    from axplug.api.summary import JsonlWriter

    return tiny_trainer_config(
        tmp_path,
        *SMALL,
        preset="llama-tiny",
        modifiers=["scan_layers", *modifiers],
        max_steps=steps,
        summary_writers=[JsonlWriter.default_config()],
    )


def train(cfg, devices=None):
    """(the final state, each step's loss) of the built train step alone: no checkpoint or
    writer, which only the checkpoint test needs."""
    state, metrics = train_steps(cfg.instantiate(devices=devices), cfg.max_steps)
    return state, [float(m["loss"]) for m in metrics]


def first_batch_grads(trainer, state=None):
    """The gradients of the loss on the first batch at the trainer's initial parameters
    (`state`'s, default: a fresh state)."""
    from axplug.api.run import loss_fn
    from axplug.api.sharding import scoped

    state = trainer.init_state() if state is None else state
    batch = trainer.put_batch(trainer.input.batch(0))
    loss = loss_fn(trainer.model, trainer.aux_loss)
    fn = jax.jit(scoped(jax.grad(lambda p: loss(p, batch, None)[0]), trainer.mesh))
    return jax.device_get(fn(state["params"]))


def grads_and_train(cfg, devices=None):
    """(first_batch_grads, the final state, each step's loss) of one trainer: its first
    batch's gradients at the initial parameters, then `train`'s steps from them (one
    initialization for both)."""
    trainer = cfg.instantiate(devices=devices)
    state = trainer.init_state()
    grads = first_batch_grads(trainer, state)
    state, metrics = train_steps(trainer, cfg.max_steps, state=state)
    return grads, state, [float(m["loss"]) for m in metrics]


@pytest.fixture(scope="module")
def scanned_run(tmp_path_factory):
    """The scanned stack on one device: (first batch gradients, final state, losses)."""
    cfg = llama8(tmp_path_factory.mktemp("scanned"), "mesh:data=1")
    return grads_and_train(cfg, devices=jax.devices()[:1])


@pytest.fixture(scope="module")
def scanned(scanned_run):
    return scanned_run[1:]


ONE_F_ONE_B = ("pipeline:stages=4,microbatches=8,schedule=1f1b", "mesh:pipeline=4,fsdp=2")


@pytest.fixture(scope="module")
def one_f_one_b(tmp_path_factory):
    """1F1B over 4 stages, for its training and its gradient tests: (grads, state, losses)."""
    return grads_and_train(llama8(tmp_path_factory.mktemp("1f1b"), *ONE_F_ONE_B))


# The circular schedule's default is two repeats: its training and gradient tests' pipeline.
CIRCULAR = ("pipeline:stages=4,microbatches=4,schedule=circular", "mesh:pipeline=4,fsdp=2")


@pytest.fixture(scope="module")
def circular(tmp_path_factory):
    """The circular schedule (two virtual stages a device), for its training and its gradient
    tests: (grads, state, losses)."""
    return grads_and_train(llama8(tmp_path_factory.mktemp("circular"), *CIRCULAR))


GPIPE = ("pipeline:stages=4,microbatches=4", "mesh:pipeline=4,fsdp=2")


@pytest.fixture(scope="module")
def gpipe(tmp_path_factory):
    """GPipe over 4 stages run 3 steps (checkpointed at the last): (run dir, final state,
    losses), for the tests of its training and of its checkpoint."""
    run_dir = tmp_path_factory.mktemp("gpipe")
    trainer = llama8(run_dir, *GPIPE).instantiate()
    trainer.run()
    losses = [r["loss"] for r in read_jsonl(f"{run_dir}/metrics.jsonl") if "loss" in r]
    return run_dir, trainer.state, losses


@pytest.mark.parametrize(
    "pipeline, mesh",
    [
        GPIPE,
        CIRCULAR,
        pytest.param(
            "pipeline:stages=2,microbatches=8,schedule=circular,repeats=4",
            "mesh:pipeline=2,data=4",
            marks=pytest.mark.slow,
        ),
        pytest.param("pipeline:stages=4,microbatches=2", "mesh:data=1", marks=pytest.mark.slow),
        ONE_F_ONE_B,
        pytest.param(
            "pipeline:stages=2,microbatches=2,schedule=1f1b",
            "mesh:pipeline=2,data=4",
            marks=pytest.mark.slow,
        ),
        ("pipeline:stages=4,microbatches=8,schedule=zbh1", "mesh:pipeline=4,fsdp=2"),
    ],
    ids=[
        "gpipe-fsdp2",
        "circular-fsdp2",
        "circular-r4-data4",
        "gpipe-one-device",
        "1f1b-fsdp2",
        "1f1b-m2-data4",
        "zbh1-fsdp2",
    ],
)
def test_pipelined_training_matches_the_scanned_stack(request, tmp_path, scanned, pipeline, mesh):
    base, base_losses = scanned
    devices = jax.devices()[:1] if mesh == "mesh:data=1" else None
    if (pipeline, mesh) == GPIPE:  # the run the checkpoint test restores too
        _, state, losses = request.getfixturevalue("gpipe")
    elif (pipeline, mesh) in (ONE_F_ONE_B, CIRCULAR):  # the trainers the gradient test reads
        _, state, losses = request.getfixturevalue(
            "one_f_one_b" if (pipeline, mesh) == ONE_F_ONE_B else "circular"
        )
    else:
        state, losses = train(llama8(tmp_path, pipeline, mesh), devices)
    np.testing.assert_allclose(losses, base_losses, rtol=1e-5)
    # After 3 Adam steps the parameters agree as closely as the losses.
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6),
        jax.device_get(state["params"]),
        jax.device_get(base["params"]),
    )
    if devices is None:  # each stage's layers live on its own `pipeline` devices
        weight = state["params"]["decoder"]["transformer"]["layer"]["attention"]
        weight = jax.tree.leaves(weight)[0]
        stages = int(pipeline.split("stages=")[1].split(",")[0])
        assert weight.sharding.shard_shape(weight.shape)[0] == 8 // stages


@pytest.mark.parametrize(
    "pipeline",
    [
        "pipeline:stages=4,microbatches=4,schedule=circular",
        "pipeline:stages=4,microbatches=8,schedule=1f1b",
    ],
)
def test_gradients_match_the_scanned_stack(request, scanned_run, pipeline):
    want = scanned_run[0]
    # The trainers their training tests ran (the same pipeline and mesh).
    run = {ONE_F_ONE_B: "one_f_one_b", CIRCULAR: "circular"}[(pipeline, "mesh:pipeline=4,fsdp=2")]
    got = request.getfixturevalue(run)[0]
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-4, atol=1e-7), got, want)


def test_a_pipelined_checkpoint_restores_into_a_scanned_run(tmp_path, gpipe):
    from axplug.api.run import restore_weights

    run_dir, state, _ = gpipe
    target = llama8(tmp_path / "scan", "mesh:fsdp=8").instantiate()
    step, params, opt_state = restore_weights(
        str(run_dir),
        None,
        abstract_state=target.layout.abstract,
        optimizer=True,
    )
    assert step == 3
    saved = jax.device_get(state)
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(params), saved["params"])
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(opt_state), saved["opt_state"])


class MeanRecordingFeedForward(FeedForward):
    """A FeedForward that records the mean of its input: a value per layer and microbatch."""

    def forward(self, x):
        self.add_module_output("input_mean", jnp.mean(x))
        self.add_summary("input_mean", jnp.mean(x))
        return super().forward(x)


def test_layer_outputs_come_back_per_layer_averaged_over_microbatches():
    """RepeatedTransformer's [num_layers] outputs, in layer order, for every schedule."""

    def outputs(*modifiers, params=None):
        cfg = llama8("/tmp/unused", *modifiers, "mesh:data=1")
        cfg = replace_config(
            cfg, target=FeedForward, new_cfg=MeanRecordingFeedForward.default_config()
        )
        trainer = cfg.instantiate(devices=jax.devices()[:1])
        # The pipelined stacks take the scanned stack's parameters as they are (the same tree
        # on the same device): one initialization for the three.
        params = trainer.init_state()["params"] if params is None else params
        batch = trainer.input.batch(0)

        @jax.jit  # one program, not one per op
        def means(params, inputs):
            _, collection = functional(
                trainer.model, prng_key=None, state=params, inputs=inputs, is_training=False
            )
            layer = collection.module_outputs["decoder"]["transformer"]["layer"]
            summary = collection.summaries["decoder"]["transformer"]["layer"]
            return layer["feed_forward"]["input_mean"], summary["feed_forward"]["input_mean"]

        out = means(params, {k: jnp.asarray(batch[k]) for k in ("input_ids", "target_labels")})
        return out, params

    (want_output, want_summary), params = outputs()
    assert want_output.shape == (8,) and len(set(np.asarray(want_output).tolist())) == 8
    for pipeline in (
        "pipeline:stages=4,microbatches=2",
        "pipeline:stages=2,microbatches=4,schedule=circular",
    ):
        (got_output, got_summary), _ = outputs(pipeline, params=params)
        np.testing.assert_allclose(got_output, want_output, rtol=1e-5)
        np.testing.assert_allclose(got_summary, want_summary, rtol=1e-5)


def test_bubble_fraction():
    assert bubble_fraction(4, 4) == pytest.approx(3 / 7)
    assert bubble_fraction(4, 8, repeats=2) == pytest.approx(3 / 19)
    assert bubble_fraction(1, 5) == 0.0
    # 1F1B: F-only and B-only ticks at the ends; ZB-H1: W fills M of the Bi ticks.
    assert bubble_fraction(4, 16, schedule="1f1b") == pytest.approx(3 / 19)
    assert bubble_fraction(4, 16, schedule="zbh1") == pytest.approx(6 / 54)
    for stages, micro in ((2, 2), (4, 8), (8, 32), (4, 2)):
        assert bubble_fraction(stages, micro, schedule="zbh1") < bubble_fraction(
            stages, micro, schedule="1f1b"
        )


def test_zero_bubble_table_runs_each_weight_gradient_after_its_input_gradient():
    from axplug_pipeline.one_f_one_b import schedule_table

    S, M = 4, 8
    table = schedule_table("zbh1", S, M)
    when = {}
    for t, row in enumerate(table):
        for s, cell in enumerate(row):
            for kind, m in cell:
                assert (kind, s, m) not in when  # each once
                when[kind, s, m] = t
    assert len(when) == 3 * S * M
    for s in range(S):
        for m in range(M):
            assert when["F", s, m] < when["Bi", s, m] <= when["W", s, m]
            if s > 0:
                assert when["F", s - 1, m] < when["F", s, m]
            if s < S - 1:
                assert when["Bi", s + 1, m] < when["Bi", s, m]
    assert len({t for (kind, _, _), t in when.items() if kind == "W"}) == M


def test_1f1b_keeps_activation_memory_flat_in_the_microbatches():
    """GPipe keeps every microbatch's activations for the backward pass; 1F1B at most
    2S - 1 stage inputs, so its temp memory does not grow with M and is far below GPipe's."""

    def temp(schedule, microbatches):
        cfg = llama8(
            "/tmp/unused",
            f"pipeline:stages=4,microbatches={microbatches},schedule={schedule}",
            "mesh:pipeline=4,data=2",
        )
        cfg = cfg.clone(input=cfg.input.clone(batch_size=32))
        # One layer a stage: what a stage keeps scales with its layers, for both schedules.
        cfg.model.decoder.transformer.set(num_layers=4, remat_policy="none")
        trainer = cfg.instantiate()
        token = jax.ShapeDtypeStruct((32, 32), jnp.int32, sharding=trainer.batch_sharding)
        lowered = trainer._train_step.lower(
            trainer.layout.abstract, {"input_ids": token, "target_labels": token}
        )
        return lowered.compile().memory_analysis().temp_size_in_bytes

    gpipe4, gpipe16 = temp("gpipe", 4), temp("gpipe", 16)
    f1b4, f1b16 = temp("1f1b", 4), temp("1f1b", 16)
    assert f1b16 <= f1b4 and f1b4 < gpipe4 / 2 and f1b16 < gpipe16 / 2, (
        gpipe4,
        gpipe16,
        f1b4,
        f1b16,
    )


def test_1f1b_refuses_layers_with_outputs():
    from axplug.api.run import loss_fn

    class PenalizedFeedForward(FeedForward):
        def forward(self, x):
            self.add_module_output("penalty_loss", jnp.sum(x))
            return super().forward(x)

    cfg = llama8("/tmp/unused", "pipeline:stages=2,microbatches=2,schedule=1f1b", "mesh:data=1")
    cfg = replace_config(cfg, target=FeedForward, new_cfg=PenalizedFeedForward.default_config())
    trainer = cfg.instantiate(devices=jax.devices()[:1])
    params = trainer.layout.abstract["params"]  # traced, as a train step is: nothing to run
    batch = trainer.input.batch(0)
    with pytest.raises(ConfigError, match="schedule: the layers record outputs or state updates"):
        jax.eval_shape(loss_fn(trainer.model, trainer.aux_loss), params, batch, None)


@pytest.mark.parametrize(
    "override, message",
    [
        ("schedule='1f2b'", "unknown schedule '1f2b'"),
        ("num_stages=3", "num_layers=8 does not split into 3 stages"),
        ("schedule='circular'", "needs num_microbatches (2) >= num_stages (4)"),
    ],
)
def test_bad_pipelines_are_config_errors(tmp_path, override, message):
    cfg = tiny_trainer_config(
        tmp_path,
        *SMALL,
        f"model.decoder.transformer.{override}",
        preset="llama-tiny",
        modifiers=["pipeline:stages=4,microbatches=2"],
    )
    with pytest.raises(ConfigError, match="model.decoder.transformer") as err:
        cfg.model.instantiate(parent=None)
    assert message in str(err.value)


def test_microbatches_must_divide_the_batch(tmp_path):
    cfg = llama8(tmp_path, "pipeline:stages=2,microbatches=3", "mesh:data=1")
    trainer = cfg.instantiate(devices=jax.devices()[:1])
    with pytest.raises(ConfigError, match="num_microbatches=3 does not divide the batch of 8"):
        trainer.run()
