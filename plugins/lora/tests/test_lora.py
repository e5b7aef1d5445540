"""LoRA: the layer, the modifier's frozen base, merged and PEFT exports against transformers
and PEFT, sharded runs against one device."""

import json
import os
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from axplug_lora import TRAINABLE, LoRAAdapter
from axplug_testing import LayerConformance, tiny_trainer_config
from axplug_testing import cli_main as main

from axplug.api.config import ConfigError, find_configs
from axplug.api.layers import fold_layers, functional
from axplug.api.run import Trainer, parameter_paths

# One device (the `mesh` modifier), small rows.
SMALL = ["--set", "compilation_cache_dir=None", "--set", "input.seq_len=16",
         "--set", "input.batch_size=8", "--mesh-rule", "none", "--modifier", "mesh",
         "-q"]  # fmt: skip


class TestLoRAAdapterConformance(LayerConformance):
    @pytest.fixture
    def layer_config(self):
        # lora_b random: at PEFT's zero init every output, so every gradient here, is zero.
        return LoRAAdapter.default_config().set(
            input_dim=16, output_dim=24, rank=4, zero_init=False
        )

    @pytest.fixture
    def swap_modifier(self):
        from axplug.api.config import make_modifier

        return make_modifier("lora:4")


def _trainer(tmp_path, name, *overrides, modifiers=("lora:rank=4",), steps=3, devices=None):
    # One layer: what these tests count and compare holds per layer (the formula counts the
    # layers); a step of one traces and compiles in about half the CPU time of two layers'.
    cfg = tiny_trainer_config(
        tmp_path / name, "model.decoder.transformer.num_layers=1", *overrides,
        preset="llama-tiny", modifiers=modifiers, max_steps=steps
    )  # fmt: skip
    return Trainer(cfg, devices=devices)


def _train(trainer, steps):
    state = trainer.init_state()
    first = jax.device_get(state["params"])
    for step in range(steps):
        state, _ = trainer._train_step(state, trainer.put_batch(trainer.input.batch(step)))
    return first, state


@pytest.fixture(scope="module")
def lora_steps(tmp_path_factory):
    """(trainer, its first parameters, the state after 3 steps, the parameters after 2) of
    llama-tiny with LoRA on one device."""
    trainer = _trainer(tmp_path_factory.mktemp("lora"), "lora", "learner.learning_rate=0.01")
    first, two = _train(trainer, 2)
    two_params = jax.device_get(two["params"])  # the next step donates the state's arrays
    state, _ = trainer._train_step(two, trainer.put_batch(trainer.input.batch(2)))
    return trainer, first, state, two_params


def test_only_the_adapters_train_and_hold_optimizer_state(lora_steps):
    trainer, first, state, _ = lora_steps
    adapted = find_configs(trainer.config.model, LoRAAdapter)
    assert len(adapted) == 3  # in qkv's, output's and the feed-forward's Linear configs
    paths = jax.tree.leaves(parameter_paths(first))
    before, after = jax.tree.leaves(first), jax.tree.leaves(jax.device_get(state["params"]))
    trained = 0
    for path, old, new in zip(paths, before, after, strict=True):
        if path.endswith(("adapter/lora_a", "adapter/lora_b")):
            trained += old.size
            if path.endswith("lora_b"):
                assert np.abs(new).max() > 0, path  # it trained
        else:
            assert np.array_equal(old, new), path  # the base is bit-identical
    # The formula: rank x (in + out) for each adapted projection of each layer.
    specs = trainer.param_specs
    layer = specs["decoder"]["transformer"]["layer0"]
    weights = [layer["attention"][k]["weight"].shape for k in ("output",)]
    weights += [layer["attention"]["qkv"][k]["weight"].shape for k in ("q", "k", "v")]
    weights += [layer["feed_forward"][k]["weight"].shape for k in ("wi_gate", "wi_up", "wo")]
    layers = len(specs["decoder"]["transformer"])
    assert trained == layers * sum(4 * (i + o) for i, o in weights)
    moments = sum(x.size for x in jax.tree.leaves(state["opt_state"]) if x.ndim > 0)
    assert moments == 2 * trained  # Adam's two moments, for the adapters only
    assert trainer.config.learner.trainable == TRAINABLE


def test_merged_logits_equal_the_unmerged_model(lora_steps):
    trainer, _, state, _ = lora_steps
    params = jax.device_get(state["params"])
    ids = jnp.asarray(np.random.default_rng(0).integers(0, 200, (2, 12)), jnp.int32)

    def logits(cfg, p):
        return predict(cfg.clone(name="model").instantiate(parent=None), p, ids)

    merged_cfg, merged = fold_layers(trainer.config.model, params)
    assert not find_configs(merged_cfg, LoRAAdapter)
    assert "lora_a" not in json.dumps(jax.tree.map(lambda x: 0, merged))
    unmerged = logits(trainer.config.model, params)
    np.testing.assert_allclose(logits(merged_cfg, merged), unmerged, rtol=1e-5, atol=1e-5)
    base = logits(merged_cfg, fold_layers(trainer.config.model, jax.tree.map(
        lambda p: p, _zeroed_b(params)))[1])  # fmt: skip
    assert np.abs(base - unmerged).max() > 1e-3  # the adapters changed the model


def _zeroed_b(params):
    def visit(tree):
        return {k: (np.zeros_like(v) if k == "lora_b" else visit(v)) if isinstance(v, dict)
                or k == "lora_b" else v for k, v in tree.items()}  # fmt: skip

    return visit(params)


def test_sharded_run_equals_one_device(tmp_path, lora_steps):
    one_device, one = lora_steps[0], lora_steps[3]  # its parameters after 2 steps
    assert len(one_device.mesh.devices.flat) == 1
    many = _trainer(tmp_path, "many", "learner.learning_rate=0.01", "mesh.mesh_shape=(2,2,1,1,2)")
    assert len(many.mesh.devices.flat) == 8
    _, b = _train(many, 2)
    jax.tree.map(
        lambda x, y: np.testing.assert_allclose(x, y, rtol=2e-5, atol=2e-5),
        one,
        jax.device_get(b["params"]),
    )
    # The adapters are laid out like their base weights' axes.
    q = many.layout.shardings["params"]["decoder"]["transformer"]["layer0"]["attention"]["qkv"]["q"]
    a, b = q["adapter"]["lora_a"].spec, q["adapter"]["lora_b"].spec
    assert a[0] == q["weight"].spec[0] and a[1] is None
    assert b[1] == q["weight"].spec[1] and b[0] is None


def test_modifier_errors_name_the_option():
    from axplug.api.config import make_modifier

    cfg = tiny_trainer_config("/tmp/unused", preset="llama-tiny")
    with pytest.raises(ConfigError, match="modifier lora: rank must be an int >= 1"):
        make_modifier("lora:rank=-1")(cfg)
    with pytest.raises(ConfigError, match="match no Linear layer within 'vision'"):
        make_modifier("lora:within=vision")(cfg)  # a text model has no tower
    with_lora = make_modifier("lora:4")(cfg)
    assert find_configs(with_lora.model, LoRAAdapter)
    back = make_modifier("lora:none")(with_lora)
    assert not find_configs(back.model, LoRAAdapter) and back.learner.trainable is None
    with pytest.raises(ConfigError, match="learner.trainable: .* matches no trained param"):
        tiny_trainer_config("/tmp/unused", preset="llama-tiny",
                            modifiers=["lora:targets=['nowhere']"]).instantiate()  # fmt: skip


# --- import, LoRA fine-tune, merged and PEFT exports, against transformers and PEFT ---------


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory):
    """(transformers model, its import, a 4-step LoRA run over the import): built once per
    module; tests only read them (one moves the import away and puts it back)."""
    transformers = pytest.importorskip("transformers")
    from axplug_models.testing import tiny_transformers_model

    tmp_path = tmp_path_factory.mktemp("lora_run")

    config = transformers.LlamaConfig(
        vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
    )  # fmt: skip
    hf = str(tmp_path / "hf")
    tiny_transformers_model(config).save_pretrained(hf)
    imported = str(tmp_path / "imported")
    assert main(["import-hf", hf, "--output", imported, "--modifier", "mesh"]) == 0
    run = str(tmp_path / "lora")
    assert main(_lora_train_argv(imported, run, 4)) == 0
    return hf, imported, run


def _lora_train_argv(imported, out, steps, *extra):
    """`axplug train` of `steps` LoRA steps over `imported`, as `lora_run` trains."""
    return ["train", "--from", imported, "--output-dir", str(out), "--input",
            "synthetic:vocab_size=96", "--modifier", "lora:rank=4,alpha=8,targets=['q','v','wo']",
            "--set", "learner.learning_rate=0.05", "--set", "learner.warmup_steps=0",
            "--set", "learner.schedule='constant'", "--max-steps", str(steps), *SMALL,
            *extra]  # fmt: skip


def _axplug_logits(run, ids):
    from axplug.api.run import load_checkpoint

    loaded = load_checkpoint(run)
    return loaded.logits(ids), loaded


# The token ids every test feeds the models: one shape, so one program per model.
IDS = np.random.default_rng(1).integers(0, 96, (2, 10))


@pytest.fixture(scope="module")
def lora_logits(lora_run):
    """(the LoRA run loaded, its logits of IDS): read by the tests, never changed."""
    logits, loaded = _axplug_logits(lora_run[2], IDS)
    return loaded, logits


def predict(model, params, ids) -> np.ndarray:
    """`model`'s logits of `ids`, compiled as one program (not one per op)."""
    fn = lambda p, i: functional(  # noqa: E731
        model, prng_key=None, state=p, inputs=(i,), method="predict", is_training=False
    )[0]
    return np.asarray(jax.jit(fn)(params, jnp.asarray(ids, jnp.int32)))


def test_lora_from_an_import_keeps_the_base_and_exports_merged_and_peft(tmp_path, lora_run,
                                                                       lora_logits):  # fmt: skip
    torch = pytest.importorskip("torch")
    peft = pytest.importorskip("peft")
    transformers = pytest.importorskip("transformers")
    hf, imported, run = lora_run
    ids = IDS
    loaded, logits = lora_logits
    base_logits, base_loaded = _axplug_logits(imported, ids)
    assert np.abs(logits - base_logits).max() > 1e-3  # the adapters trained
    # The frozen base is the import's, bit for bit.
    base = base_loaded.params["decoder"]["transformer"]["layer0"]
    tuned = loaded.params["decoder"]["transformer"]["layer0"]
    np.testing.assert_array_equal(
        np.asarray(tuned["attention"]["qkv"]["q"]["weight"]),
        np.asarray(base["attention"]["qkv"]["q"]["weight"]),
    )

    merged = str(tmp_path / "merged")
    assert main(["export-hf", run, "--output", merged]) == 0
    model = transformers.AutoModelForCausalLM.from_pretrained(merged, dtype=torch.float32)
    with torch.no_grad():
        got = model(torch.as_tensor(ids)).logits.numpy()
    np.testing.assert_allclose(got, logits, rtol=1e-4, atol=1e-4)

    adapter = str(tmp_path / "adapter")
    assert main(["export-lora", run, "--output", adapter]) == 0
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    umask = os.umask(0o022)
    os.umask(umask)
    for directory in (merged, adapter):  # readable as the umask says, by a server of any user
        modes = {p.name: p.stat().st_mode & 0o777 for p in pathlib.Path(directory).iterdir()}
        assert set(modes.values()) == {0o666 & ~umask}, modes
    assert config["target_modules"] == ["down_proj", "q_proj", "v_proj"]
    base_model = transformers.AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32)
    with_adapter = peft.PeftModel.from_pretrained(base_model, adapter)
    with torch.no_grad():
        got = with_adapter(torch.as_tensor(ids)).logits.numpy()
    np.testing.assert_allclose(got, logits, rtol=1e-4, atol=1e-4)


def test_export_lora_refuses_a_run_without_adapters(tmp_path, lora_run, gpt_tiny_run, capsys):
    _, imported, _ = lora_run
    for run in (imported, gpt_tiny_run):  # an import; a preset's run no family expresses
        assert main(["export-lora", str(run), "--output", str(tmp_path / "none")]) == 2
        err = capsys.readouterr().err.strip()
        assert (
            err == f"error: export-lora: {run} has no LoRA adapters (train it with --modifier lora)"
        )
        assert not (tmp_path / "none").exists()


# --- adapter-only checkpoints -----------------------------------------------------------------


def _saved_elements(run):
    """The number of parameter elements the latest step of `run` stores."""
    from axplug.api.checkpoint import Checkpointer

    with Checkpointer.default_config().set(directory=f"{run}/checkpoints").instantiate() as c:
        tree = c.saved_tree(c.latest_step())["params"]
    return sum(int(np.prod(leaf.shape)) for leaf in jax.tree.leaves(tree))


def test_a_lora_checkpoint_stores_the_adapters_and_names_its_base(tmp_path, lora_run):
    from axplug.api.checkpoint import Checkpointer

    _, imported, run = lora_run
    cfg = Checkpointer.default_config().set(directory=f"{run}/checkpoints")
    with cfg.instantiate() as checkpointer:
        step = checkpointer.latest_step()
        paths = jax.tree.leaves(parameter_paths(checkpointer.saved_tree(step)["params"]))
        source = checkpointer.metadata(step)["frozen"]
    assert paths and all(p.endswith(("adapter/lora_a", "adapter/lora_b")) for p in paths)
    assert source["from"].endswith("imported/checkpoints") and source["step"] == 0
    # rank 4 on q and v (in 32, out 32 and 16) and wo (in 48, out 32), in each of 2 layers
    assert _saved_elements(run) == 2 * 4 * ((32 + 32) + (32 + 16) + (48 + 32))
    assert _saved_elements(imported) > 10 * _saved_elements(run)  # the base: 21,664


def test_a_lora_run_resumes_bit_exact_from_its_adapter_checkpoint(tmp_path, lora_run):
    _, imported, whole_run = lora_run  # 4 steps in one go
    halves_run = tmp_path / "halves"
    assert main(_lora_train_argv(imported, halves_run, 2, "--checkpoint-every", "2")) == 0
    # Resumes at step 2: adapters from its checkpoint, base from the import.
    assert main(_lora_train_argv(imported, halves_run, 4, "--checkpoint-every", "2")) == 0
    from axplug.api.run import load_checkpoint

    whole, halves = (load_checkpoint(str(r)) for r in (whole_run, halves_run))
    assert whole.step == halves.step == 4
    jax.tree.map(np.testing.assert_array_equal, whole.params, halves.params)


def test_a_missing_base_is_named(tmp_path, lora_run, capsys):
    import shutil

    _, imported, run = lora_run
    shutil.move(imported, str(tmp_path / "moved"))
    try:
        capsys.readouterr()
        assert main(["export-hf", run, "--output", str(tmp_path / "out")]) != 0
        err = capsys.readouterr().err
        assert "stores only its trained parameters" in err and "imported/checkpoints" in err
        assert not os.path.exists(imported)  # nothing recreated where the base was
    finally:
        shutil.move(str(tmp_path / "moved"), imported)


def test_adapters_refuse_a_base_replaced_in_place_unless_told(tmp_path, lora_run, monkeypatch,
                                                               capsys):  # fmt: skip
    import shutil

    import transformers
    from axplug_models.testing import tiny_transformers_model

    from axplug.api.checkpoint import ALLOW_CHANGED_BASE_ENV

    hf, imported, run = lora_run
    other = str(tmp_path / "other-hf")  # the same shapes, other weights
    config = transformers.AutoConfig.from_pretrained(hf)
    tiny_transformers_model(config, seed=1).save_pretrained(other)
    shutil.move(imported, str(tmp_path / "original"))
    try:
        assert main(["import-hf", other, "--output", imported, "--modifier", "mesh"]) == 0
        capsys.readouterr()
        for argv in (
            ["export-hf", run, "--output", str(tmp_path / "out")],
            ["generate", "--checkpoint", run, "--prompt-ids", "1,2,3", "--max-new-tokens", "2"],
        ):
            assert main(argv) != 0
            err = capsys.readouterr().err.strip()
            assert "whose parameters changed since this fine-tune began" in err, err
            assert f"{imported}/checkpoints" in err and ALLOW_CHANGED_BASE_ENV in err
            assert len(err.splitlines()) == 1 and not (tmp_path / "out").exists()
        monkeypatch.setenv(ALLOW_CHANGED_BASE_ENV, "1")  # told: this base it is
        assert _axplug_logits(run, IDS)[1].step == 4
    finally:
        shutil.rmtree(imported, ignore_errors=True)
        shutil.move(str(tmp_path / "original"), imported)


def test_qlora_adapters_train_over_a_quantized_frozen_base(tmp_path):
    pytest.importorskip("axplug_quantize")
    trainer = _trainer(tmp_path, "qlora", "learner.learning_rate=0.01",
                       modifiers=("quantize:int8", "lora:rank=4"))  # fmt: skip
    from axplug_quantize import QuantizedLinear

    assert find_configs(trainer.config.model, QuantizedLinear)
    first, state = _train(trainer, 3)
    after = jax.device_get(state["params"])
    q = lambda p: p["decoder"]["transformer"]["layer0"]["attention"]["qkv"]["q"]  # noqa: E731
    np.testing.assert_array_equal(q(first)["weight"], q(after)["weight"])
    assert np.abs(q(after)["adapter"]["lora_b"]).max() > 0
    # The quantized matmul is in the step: an int8 x int8 dot.
    assert "xi8>" in trainer.lower_step().as_text()


def test_decoding_merged_equals_unmerged(tmp_path, lora_run, lora_logits, capsys):
    from axplug.api.run import load_checkpoint

    _, _, run = lora_run
    ids, (_, unmerged) = IDS, lora_logits
    merged = load_checkpoint(run, merge_adapters=True)
    assert not find_configs(merged.config.model, LoRAAdapter)
    assert "adapter" not in json.dumps(jax.tree.map(lambda x: 0, merged.params))
    out = predict(merged.model, merged.params, ids)
    np.testing.assert_allclose(out, unmerged, rtol=1e-5, atol=1e-5)
    greedy = []
    for extra in ([], ["--merge-adapters"]):
        argv = ["generate", "--checkpoint", run, "--prompt-ids", "5,6,7", "--temperature", "0",
                "--max-new-tokens", "6", "--json", *extra]  # fmt: skip
        assert main(argv) == 0
        greedy.append(json.loads(capsys.readouterr().out)["output_ids"])
    assert greedy[0] == greedy[1] and len(greedy[0]) >= 1
