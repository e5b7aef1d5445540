"""The sharding scope: activation layouts, sequence parallelism and flat weak scaling.

Per-device FLOPs and temp memory come from XLA's analysis of the compiled (partitioned) step:
deterministic, so they are asserted. Losses on different meshes reduce in different orders
and agree to ~1e-5 relative (float32).
"""

import functools
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from axplug_aot.report import DUMP_FILES, compile_report
from axplug_testing import tiny_trainer_config
from jax.sharding import PartitionSpec

from axplug.mesh import DEFAULT_AXIS_RULES, MeshBuilder
from axplug.sharding import (
    constrain,
    current_scope,
    make_scope,
    map_over_batch,
    mesh_axis_size,
    sharding_scope,
)


def mesh_of(**axes):
    shape = tuple(axes.get(a, 1) for a in ("data", "fsdp", "expert", "seq", "model"))
    builder = MeshBuilder.default_config().set(mesh_shape=shape).instantiate()
    return builder.build(jax.devices()[: math.prod(shape)])


def constraint_specs(fn, *args):
    """The shardings of every sharding_constraint in `fn`'s jaxpr."""
    jaxpr = jax.make_jaxpr(fn)(*args)
    return [
        e.params["sharding"].spec for e in jaxpr.eqns if e.primitive.name.startswith("sharding")
    ]


def test_constrain_outside_a_scope_is_the_identity():
    x = jnp.ones((4, 8, 16))
    assert current_scope() is None
    assert constrain(x, ("batch", "seq", "act_embed")) is x
    assert constraint_specs(lambda x: constrain(x, ("batch", "seq", "act_embed")), x) == []
    assert mesh_axis_size("batch") == 1


def test_scope_maps_logical_axes_to_mesh_axes():
    mesh = mesh_of(data=2, fsdp=2, seq=2)
    x = jnp.ones((4, 8, 16))

    def f(x):
        with sharding_scope(mesh):
            return constrain(x, ("batch", "seq", "act_embed"))

    assert constraint_specs(f, x) == [PartitionSpec(("data", "fsdp"), "seq", None)]
    with sharding_scope(mesh) as scope:
        assert mesh_axis_size("batch") == 4 and mesh_axis_size("seq") == 2
        # A dim the mesh axes do not divide stays whole rather than failing.
        assert scope.spec(("batch", "seq"), (3, 8)) == PartitionSpec(None, "seq")
        with sharding_scope(None):
            assert current_scope() is None  # an inner None scope turns constraints off
    assert current_scope() is None
    with pytest.raises(ValueError, match="2 logical axes for a 3-d array"), sharding_scope(mesh):
        constrain(x, ("batch", "seq"))


def test_scope_falls_back_to_jax_set_mesh_with_the_default_rules():
    mesh = mesh_of(fsdp=8)
    with jax.set_mesh(mesh):
        scope = current_scope()
        assert scope is not None and scope.rules == DEFAULT_AXIS_RULES
        specs = constraint_specs(lambda x: constrain(x, ("batch", None)), jnp.ones((8, 2)))
    assert specs == [PartitionSpec("fsdp", None)]


def test_make_scope_freezes_saved_rules_and_fills_missing_axes():
    # Rules as a run's saved config gives them back: lists, and no activation axes.
    saved = [("batch", ["data", "fsdp"]), ("embed", "fsdp"), ("seq", "seq")]
    scope = make_scope(mesh_of(fsdp=8), saved)
    hash(scope)  # static argument of jitted decoding functions
    rules = dict(scope.rules)
    assert rules["batch"] == ("data", "fsdp") and rules["act_embed"] is None
    assert make_scope(None, saved) is None


# --- train steps on 8 fake devices equal one device --------------------------------------


def small_llama(tmp_path, *modifiers, batch=8, seq=64, extra=()):
    return tiny_trainer_config(
        tmp_path,
        "model.decoder.transformer.num_layers=2",
        f"input.seq_len={seq}",
        f"input.batch_size={batch}",
        *extra,
        preset="llama-tiny",
        modifiers=modifiers,
    )


def two_steps(cfg, devices, state=None):
    """(loss, grad_norm) of step 1 and the loss of step 2 from the same initial state, and
    that state (read back): `state`, copied onto the trainer's layout, or a fresh one."""
    trainer = cfg.instantiate(devices=devices)
    if state is None:
        state = trainer.init_state()
    else:
        state = jax.device_put(state, trainer.layout.shardings, may_alias=False)
    initial = jax.device_get(state)
    batches = trainer.input.iter_from(0)
    out = []
    for _ in range(2):
        state, metrics = trainer._train_step(state, trainer.put_batch(next(batches)[1]))
        out.append(jax.device_get(metrics))
    return [out[0]["loss"], out[0]["grad_norm"], out[1]["loss"]], initial


# Plain fsdp=8 is the fsdp-scan-remat case's mesh, and fsdp+model shards unscanned layers over
# fsdp: each case below adds a path (data replicas, stacked layers, model, seq) of its own.
LAYOUTS = {
    "data": ["mesh:data=8"],
    "fsdp-scan-remat": ["mesh:fsdp=8", "scan_layers:remat_policy=full"],
    "fsdp+model": ["mesh:fsdp=4,model=2"],
    "seq": ["mesh:seq=8"],
    "fsdp+seq+model": ["mesh:fsdp=2,seq=2,model=2", "scan_layers:remat_policy=full"],
}


@functools.cache
def one_device(*modifiers):
    """The one-device reference of `two_steps` (and its initial state), shared by the layouts
    that need it."""
    return two_steps(small_llama("/nonexistent/one", *modifiers), jax.devices()[:1])


# The layout that also draws its own initial state on its mesh (the others start from the one
# device's: an init program per mesh is a compile of its own, and what a layout changes
# is the step). Its every mesh axis at once: initialization on a mesh still agrees too.
OWN_INIT = "fsdp+seq+model"


@pytest.mark.parametrize("layout", LAYOUTS)
def test_layouts_train_like_one_device(tmp_path, layout):
    modifiers = LAYOUTS[layout]
    want, initial = one_device(*(m for m in modifiers if not m.startswith("mesh:")))
    state = None if layout == OWN_INIT else initial
    got, _ = two_steps(small_llama(tmp_path / "many", *modifiers), jax.devices(), state)
    np.testing.assert_allclose(got, want, rtol=1e-5)


# --- per-device cost of the compiled step ----------------------------------------------------


def _param_shapes(cfg) -> set[tuple[int, ...]]:
    """Every parameter's shape, and its per-layer slice (what a scanned layer gathers)."""
    model = cfg.model.instantiate(parent=None, _path="model")
    shapes = set()
    init = jax.eval_shape(model.initialize_parameters_recursively, jax.random.PRNGKey(0))
    for leaf in jax.tree.leaves(init):
        shapes |= {tuple(leaf.shape), tuple(leaf.shape[1:])}
    return shapes


def _not_parameter_shaped(gathered, params) -> set[tuple[int, ...]]:
    """Gathered shapes that are no parameter's shape or a shard of one (dims dividing it)."""
    return {
        g
        for g in gathered
        if not any(
            len(p) == len(g) and all(d and s % d == 0 for d, s in zip(g, p, strict=True))
            for p in params
        )
    }


def _all_gather_shapes(hlo: str) -> list[tuple[int, ...]]:
    """The result shapes of every all-gather (each element of a tuple-shaped one)."""
    results = re.findall(r"= ([^=]*?) all-gather(?:-start)?\(", hlo)
    shapes = [dims for result in results for dims in re.findall(r"[a-z0-9]+\[([0-9,]*)\]", result)]
    return [tuple(int(d) for d in dims.split(",") if d) for dims in shapes]


def compile_step(cfg, devices: int):
    """(per-device FLOPs, temp bytes, HLO text) of the compiled train step on `devices`."""
    trainer = cfg.instantiate(devices=jax.devices()[:devices])
    b, s = cfg.input.batch_size, cfg.input.seq_len
    token = jax.ShapeDtypeStruct((b, s), jnp.int32, sharding=trainer.batch_sharding)
    batch = {"input_ids": token, "target_labels": token}
    compiled = trainer.lower_step(batch).compile()
    flops = compiled.cost_analysis()["flops"]
    return flops, compiled.memory_analysis().temp_size_in_bytes, compiled.as_text()


@pytest.mark.parametrize(
    "modifiers",
    [["mesh:fsdp=-1"], ["mesh:fsdp=-1", "scan_layers:remat_policy=full"]],
    ids=["unrolled", "scan-remat"],
)
def test_fsdp_weak_scaling_is_flat_and_gathers_only_parameters(tmp_path, modifiers):
    costs = {}
    for n in (2, 8):  # one sequence per device; 8 scanned: the fsdp-scan-remat layout's step
        cfg = small_llama(tmp_path, *modifiers, batch=n)
        costs[n] = compile_step(cfg, n)
    (f2, t2, _), (f8, t8, hlo) = costs[2], costs[8]
    assert f8 / f2 <= 1.03 and t8 / t2 <= 1.03, (f8 / f2, t8 / t2)
    # FSDP gathers weights before use and never the batch of activations.
    gathered = _all_gather_shapes(hlo)
    params = _param_shapes(small_llama(tmp_path, *modifiers, batch=8))
    assert gathered and not _not_parameter_shaped(gathered, params)


def test_sequence_parallel_divides_the_work_of_one_sequence(tmp_path):
    seq = 2048
    one = compile_step(small_llama(tmp_path, "mesh:data=1", batch=1, seq=seq), 1)
    eight = compile_step(small_llama(tmp_path, "mesh:seq=8", batch=1, seq=seq), 8)
    flops, temp = eight[0] / one[0], eight[1] / one[1]
    assert flops <= 0.14 and temp <= 0.18, (flops, temp)  # ideal 0.125


def test_moe_expert_parallel_step_gathers_only_parameters(tmp_path):
    # The MoE dispatch reads the scope the Trainer jits in, so AOT sees the all-to-alls.
    # (plugins/ffn_moe/tests/test_moe_plugin.py checks expert-parallel losses against one device.)
    cfg = small_llama(tmp_path, "moe:num_experts=4,top_k=2", "mesh:fsdp=2,expert=4")
    # The report's own compiled step, dumped: not a second trace and lowering of it.
    report = compile_report(cfg, num_devices=8, max_devices=8, dump_dir=str(tmp_path / "dump"))
    assert report.collectives.get("all-to-all", 0) >= 2
    gathered = _all_gather_shapes((tmp_path / "dump" / DUMP_FILES["after"]).read_text())
    assert gathered and not _not_parameter_shaped(gathered, _param_shapes(cfg))


def test_map_over_batch_runs_row_wise_ops_per_device():
    mesh = mesh_of(fsdp=8)
    x = jax.random.normal(jax.random.PRNGKey(0), (8, 16, 6))
    top2 = lambda p: jax.lax.top_k(p, 2)  # noqa: E731

    def f(x):
        with sharding_scope(mesh):
            return map_over_batch(top2, constrain(x, ("batch", None, None)))

    got = jax.jit(f)(x)
    jax.tree.map(np.testing.assert_array_equal, got, top2(x))
    hlo = jax.jit(f).lower(x).compile().as_text()
    assert "all-gather" not in hlo  # left to XLA, top_k gathers every row
    assert map_over_batch(top2, x)[0].shape == (8, 16, 2)  # no scope: a plain call


def test_count_collectives_reads_the_partitioned_hlo():
    from axplug_aot.report import count_collectives
    from jax.sharding import NamedSharding

    mesh = mesh_of(fsdp=8)
    x = jax.ShapeDtypeStruct(
        (8, 4), jnp.float32, sharding=NamedSharding(mesh, PartitionSpec("fsdp"))
    )
    gather = jax.jit(lambda x: x, out_shardings=NamedSharding(mesh, PartitionSpec()))
    total = jax.jit(lambda x: x.sum(), out_shardings=NamedSharding(mesh, PartitionSpec()))
    assert count_collectives(gather.lower(x).compile().as_text()) == {"all-gather": 1}
    assert count_collectives(total.lower(x).compile().as_text()) == {"all-reduce": 1}


def test_scope_none_and_shard_map_bodies_turn_constraints_off():
    mesh = mesh_of(fsdp=8)
    with jax.set_mesh(mesh), sharding_scope(None):
        assert current_scope() is None  # not even jax.set_mesh's mesh

    def per_shard(x):  # e.g. a kernel calling a layer inside shard_over_batch
        return constrain(x, ("batch", None)) * 2

    body = jax.shard_map(
        per_shard, mesh=mesh, in_specs=PartitionSpec("fsdp"), out_specs=PartitionSpec("fsdp")
    )
    with sharding_scope(mesh):
        out = jax.jit(body)(jnp.ones((8, 2)))
    np.testing.assert_array_equal(out, 2 * np.ones((8, 2)))


@pytest.fixture(scope="module")
def mesh_run(tmp_path_factory):
    """(directory, final parameters) of a one-step run on 8 devices (fsdp=4 x model=2)."""
    out = tmp_path_factory.mktemp("mesh_run")
    trainer = small_llama(out, "mesh:fsdp=4,model=2", extra=["max_steps=1"]).instantiate()
    trainer.run()
    return out, jax.device_get(trainer.state["params"])


@pytest.mark.parametrize(
    "modifier, overrides, message",
    [
        ("mesh:seq=8", ["input.seq_len=60"], "input.seq_len: 60 tokens cannot be split over the 8"),
        (
            "mesh:fsdp=8",
            ["input.batch_size=8", "learner.grad_accumulation_steps=2"],
            "learner.grad_accumulation_steps: 2 microbatches of 4 rows cannot be split",
        ),
    ],
)
def test_a_mesh_that_would_split_nothing_is_a_config_error(tmp_path, modifier, overrides, message):
    from axplug.config import ConfigError

    cfg = small_llama(tmp_path, modifier, extra=overrides)
    with pytest.raises(ConfigError, match=re.escape(message)):
        cfg.instantiate()


@pytest.mark.parametrize(
    "cache",
    [pytest.param("contiguous", marks=pytest.mark.slow), "paged"],  # paged: the harder
)
def test_a_run_trained_on_a_mesh_decodes_on_one_device_and_on_its_mesh(mesh_run, cache):
    """Loaded on one device (the default), the run's parameters are the trained ones and it
    decodes. Loaded onto all 8 devices (the run's fsdp=4 x model=2 mesh), parameters stay
    sharded, the engine traces the model inside the mesh's sharding scope, the KV caches split
    rows over fsdp and kv heads over model, and greedy decoding gives the tokens of the
    one-device engine."""
    from axplug.inference import Engine, Request, SamplingParams, load_checkpoint

    run, params = str(mesh_run[0]), mesh_run[1]
    modifiers = ["paged_kv_cache:page_size=4"] if cache == "paged" else []
    # One more than the slots: the last waits, and decoding steps from host ids until it joins.
    prompts = [[1, 2, 3, 4, 5], [7, 8, 9], [10, 11, 12, 13, 14, 15, 16], [6, 5], [3, 3]]
    sampling = SamplingParams(max_new_tokens=8, temperature=0.0)

    def decode(loaded, engine=None):
        engine = engine or Engine(
            loaded.model, loaded.params, num_slots=4, max_len=32,
            mesh=loaded.mesh, axis_rules=loaded.axis_rules,
        )  # fmt: skip
        for prompt in prompts:
            engine.submit(Request(prompt=prompt, sampling=sampling))
        done = sorted(engine.run(), key=lambda c: c.id)
        return [c.output_ids for c in done], engine

    one = load_checkpoint(run, modifiers=modifiers)
    assert one.mesh.devices.size == 1
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(one.params), params)
    want, _ = decode(one)
    assert [len(tokens) for tokens in want] == [8] * len(prompts)
    loaded = load_checkpoint(run, modifiers=modifiers, devices=jax.devices())
    assert dict(loaded.mesh.shape) == {"data": 1, "fsdp": 4, "expert": 1, "seq": 1, "model": 2}
    wq = jax.tree.leaves(loaded.params["decoder"]["transformer"]["layer0"]["attention"])[0]
    assert len(wq.sharding.device_set) == 8
    seen, original = [], type(loaded.model.decoder).extend_step

    def spy(self, *args, **kwargs):
        seen.append(current_scope())
        return original(self, *args, **kwargs)

    type(loaded.model.decoder).extend_step = spy
    try:
        got, engine = decode(loaded)
    finally:
        type(loaded.model.decoder).extend_step = original
    assert seen and all(s is not None and s.mesh is loaded.mesh for s in seen)
    assert got == want
    # The cache is made as the steps lay it out: later requests lower no program again (made
    # on one device, the next prefill compiled again).
    lowered = []

    def count(event, _secs, **_):
        lowered.append(event == "/jax/core/compile/jaxpr_to_mlir_module_duration")

    jax.monitoring.register_event_duration_secs_listener(count)
    try:
        assert decode(loaded, engine)[0] == want
    finally:
        jax.monitoring.unregister_event_duration_listener(count)
    assert sum(lowered) == 0
    key = engine._cache["transformer"]["layer0"]["attention"]["key"]  # [kvh, rows|pages, ...]
    spec = key.sharding.spec
    assert spec[0] == "model", spec  # kv heads over model
    if cache == "contiguous":
        assert spec[1] == "fsdp", spec  # rows over fsdp
