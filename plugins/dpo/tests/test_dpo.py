"""DPO: the losses against numpy, preference data and reference log-probabilities, and a toy
preference set where training raises the reward margin and ranks held-out pairs."""

import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from axplug_dpo import DPOCausalLM, PreferenceInput, preference_loss, sequence_logps
from axplug_testing import cli_main as main
from axplug_testing import copy_run

from axplug.api.config import ConfigError
from axplug.api.layers import functional
from axplug.api.run import load_checkpoint

# One device (the `mesh` modifier), small rows.
SMALL = ["--set", "compilation_cache_dir=None", "--set", "input.seq_len=32",
         "--set", "input.batch_size=8", "--mesh-rule", "none", "--modifier", "mesh",
         "-q"]  # fmt: skip


def _log_sigmoid(x):
    return -np.logaddexp(0.0, -x)


@pytest.mark.parametrize("kind", ["sigmoid", "ipo", "simpo"])
def test_losses_match_numpy(kind):
    rng = np.random.default_rng(0)
    policy, reference = rng.normal(-20, 5, 8), rng.normal(-20, 5, 8)
    counts = rng.integers(3, 12, 8)
    beta, gamma = 0.3, 0.4
    # One compiled program (as the train step runs it), not one per op.
    loss_fn = jax.jit(preference_loss, static_argnames=("beta", "kind", "simpo_gamma"))
    loss, metrics = loss_fn(jnp.asarray(policy), jnp.asarray(reference), jnp.asarray(counts),
                            beta=beta, kind=kind, simpo_gamma=gamma)  # fmt: skip
    c, r, rc, rr = policy[0::2], policy[1::2], reference[0::2], reference[1::2]
    nc, nr = counts[0::2], counts[1::2]
    if kind == "sigmoid":
        want = -_log_sigmoid(beta * ((c - rc) - (r - rr)))
        margin = beta * ((c - rc) - (r - rr))
    elif kind == "ipo":
        h = (c / nc - rc / nc) - (r / nr - rr / nr)
        want = (h - 1 / (2 * beta)) ** 2
        margin = beta * h
    else:
        want = -_log_sigmoid(beta * (c / nc - r / nr) - gamma)
        margin = beta * (c / nc - r / nr)
    np.testing.assert_allclose(float(loss), want.mean(), rtol=1e-5)
    np.testing.assert_allclose(float(metrics["reward_margin"]), margin.mean(), rtol=1e-5)
    np.testing.assert_allclose(float(metrics["accuracy"]), (margin > 0).mean())


def test_sequence_logps_count_only_the_labelled_targets():
    logits = jax.random.normal(jax.random.PRNGKey(0), (2, 5, 7))
    labels = jnp.asarray([[1, -1, 3, 4, -1], [-1, -1, 0, -1, 6]])
    sums, counts = jax.jit(sequence_logps)(logits, labels)  # one program, not one per op
    logp = np.asarray(jax.nn.log_softmax(logits, -1))
    want = [logp[0, 0, 1] + logp[0, 2, 3] + logp[0, 3, 4], logp[1, 2, 0] + logp[1, 4, 6]]
    np.testing.assert_allclose(np.asarray(sums), want, rtol=1e-6)
    assert list(np.asarray(counts)) == [3, 2]


def _pairs(n, seed=0):
    """Prompts of random letters; the chosen reply repeats the prompt's first letter, the
    rejected one a different letter: a preference a model can learn and generalize."""
    rng = np.random.default_rng(seed)
    letters = "abcdefghij"
    out = []
    for _ in range(n):
        prompt = "".join(rng.choice(list(letters), 4))
        wrong = letters[(letters.index(prompt[0]) + 1 + rng.integers(9)) % 10]
        out.append({"prompt": f"{prompt}>", "chosen": prompt[0] * 3, "rejected": wrong * 3})
    return out


@pytest.fixture(scope="module")
def toy(tmp_path_factory, trained_run):
    """(a 2-step llama-tiny run, preference data scored by it): built once per module, read
    by the tests (one that edits the data edits a copy)."""
    tmp_path = tmp_path_factory.mktemp("toy")
    # A copy of the session's shared 2-step llama-tiny run (other modules use it too).
    base = str(copy_run(trained_run("llama-tiny", "input.seq_len=64"), tmp_path / "base"))
    source = tmp_path / "pairs.jsonl"
    source.write_text("".join(json.dumps(p) + "\n" for p in _pairs(160)))
    data = str(tmp_path / "prefs")
    assert main(["prepare-preferences", str(source), "--tokenizer", "bytes", "--plain",
                 "--output", data, "--workers", "1"]) == 0  # fmt: skip
    assert main(["dpo-reference", "--checkpoint", base, data]) == 0
    return base, data


@pytest.fixture(scope="module")
def base_model(toy):
    """The base run of `toy`, loaded once: read by the tests."""
    return load_checkpoint(toy[0])


_LOGPS: dict = {}  # {model: its jitted logps}: each model's program traced once


def _policy_logps(model, params, batch) -> np.ndarray:
    """Each row's sequence log-probability of its labels under `model`: one compiled program
    (op by op, every op would compile for each shape)."""

    def logps(params, ids, labels):
        logits, _ = functional(model, prng_key=None, state=params, method="predict",
                               inputs={"input_ids": ids}, is_training=False)  # fmt: skip
        return sequence_logps(logits, labels)[0]

    jitted = _LOGPS.setdefault(model, jax.jit(logps))
    ids, labels = (jnp.asarray(batch[k]) for k in ("input_ids", "target_labels"))
    return np.asarray(jitted(params, ids, labels))


def _accuracy(model, params, batch):
    """The fraction of pairs whose chosen response gains more over the reference."""
    gain = _policy_logps(model, params, batch) - batch["reference_logps"].sum(-1)
    return float(np.mean(gain[0::2] > gain[1::2]))


def test_reference_logps_are_the_base_models(toy, base_model):
    base, data = toy
    meta = json.loads((pathlib.Path(data) / "meta.json").read_text())
    assert meta["token_values"]["reference_logps"]["checkpoint"].rstrip("/").endswith("base")
    # 16 rows, as the held-out batch below: one logps program for both.
    inp = PreferenceInput.default_config().set(path=data, seq_len=32, batch_size=16).instantiate()
    batch = inp.batch(0)
    want = _policy_logps(base_model.model, base_model.params, batch)
    np.testing.assert_allclose(batch["reference_logps"].sum(-1), want, atol=1e-4)
    # Rows alternate the chosen and rejected replies of one prompt.
    ids = batch["input_ids"]
    assert all(bytes(ids[i][:5].astype(np.uint8)) == bytes(ids[i + 1][:5].astype(np.uint8))
               for i in range(0, 16, 2))  # fmt: skip


def _dpo_run(tmp_path, base, data, *extra):
    run = str(tmp_path / "dpo")
    argv = ["train", "--from", base, "--output-dir", run, "--input", f"preferences:path={data}",
            "--modifier", "dpo:beta=0.5", "--set", "learner.learning_rate=0.003",
            "--set", "learner.warmup_steps=0", "--set", "learner.schedule='constant'",
            "--max-steps", "40", "--set", "log_every=1", *extra, *SMALL]  # fmt: skip
    assert main(argv) == 0
    return run


def test_dpo_raises_the_margin_and_ranks_held_out_pairs(tmp_path, toy, base_model):
    base, data = toy
    run = _dpo_run(tmp_path, base, data)
    rows = [
        json.loads(line)
        for line in pathlib.Path(run, "metrics.jsonl").read_text().split("\n")
        if line
    ]
    margins = [r["dpo/reward_margin"] for r in rows if "dpo/reward_margin" in r]
    assert len(margins) >= 30
    assert np.mean(margins[-5:]) > np.mean(margins[:5]) + 0.1
    loaded = load_checkpoint(run)
    assert isinstance(loaded.model, DPOCausalLM)
    held_out = PreferenceInput.default_config().set(
        path=data, seq_len=32, batch_size=16, split="eval", eval_fraction=0.2
    ).instantiate()  # fmt: skip
    batch = held_out.batch(0)
    tuned = _accuracy(loaded.model, loaded.params, batch)
    before = _accuracy(base_model.model, base_model.params, batch)
    print(f"held-out accuracy {before:.3f} -> {tuned:.3f}; margin {np.mean(margins[:5]):.3f} "
          f"-> {np.mean(margins[-5:]):.3f}")  # fmt: skip
    assert tuned >= 0.8 and before < 0.8


def test_with_lora_the_reference_is_the_adapter_free_model(tmp_path, toy):
    from axplug_testing import train_config

    base, data = toy
    argv = ["train", "--from", base, "--output-dir", str(tmp_path / "lora"), "--input",
            f"preferences:path={data}", "--modifier", "lora:4", "--modifier", "dpo",
            *SMALL]  # fmt: skip
    trainer = train_config(argv[1:]).instantiate()
    state = trainer.restore_or_init()
    batch = trainer.input.batch(0)

    @jax.jit  # the policy's log-probabilities and the loss: one program
    def logps_and_loss(params, inputs):
        logits, _ = functional(trainer.model, prng_key=None, state=params, method="predict",
                               inputs={"input_ids": inputs["input_ids"]},
                               is_training=False)  # fmt: skip
        loss = functional(
            trainer.model, prng_key=None, state=params, is_training=False, inputs=inputs
        )[0][0]
        return sequence_logps(logits, inputs["target_labels"])[0], loss

    policy, loss = logps_and_loss(state["params"], {k: jnp.asarray(v) for k, v in batch.items()})
    np.testing.assert_allclose(np.asarray(policy), batch["reference_logps"].sum(-1), atol=1e-4)
    # The first step's loss is log 2: policy and reference agree on every pair.
    np.testing.assert_allclose(float(loss), np.log(2), atol=1e-4)
    trainer.checkpointer.close()


def test_errors_name_the_fix(tmp_path, toy, capsys):
    import shutil

    base, shared = toy
    data = str(shutil.copytree(shared, tmp_path / "prefs"))
    meta_path = pathlib.Path(data) / "meta.json"
    meta = json.loads(meta_path.read_text())
    del meta["token_values"]
    meta_path.write_text(json.dumps(meta))
    run = str(tmp_path / "noref")
    argv = ["train", "--from", base, "--output-dir", run, "--input", f"preferences:path={data}",
            "--modifier", "dpo", "--max-steps", "1", *SMALL]  # fmt: skip
    assert main(argv) != 0
    assert "axplug dpo-reference" in capsys.readouterr().err
    from axplug.api.config import make_modifier

    with pytest.raises(ConfigError, match="modifier dpo: loss 'kto'; choose from"):
        make_modifier("dpo:kto")(None)


# --- the layer conformance kit (SimPO: no reference log-probabilities needed) ----------------

from axplug_testing import LayerConformance  # noqa: E402


class TestDPOCausalLMConformance(LayerConformance):
    @pytest.fixture
    def layer_config(self):
        from axplug_testing import tiny_trainer_config

        decoder = tiny_trainer_config("/tmp/unused", preset="llama-tiny").model.decoder
        # One layer: the checks are of the DPO wrapper, which adds nothing per layer.
        decoder.transformer.num_layers = 1
        return DPOCausalLM.default_config().set(decoder=decoder, loss="simpo")

    @pytest.fixture
    def inputs(self):
        ids = jax.random.randint(jax.random.PRNGKey(1), (4, 8), 0, 200)
        labels = jnp.where(jnp.arange(8) < 3, -1, jnp.roll(ids, -1, axis=1))  # a prompt of 3
        return (ids, labels)

    @pytest.fixture
    def swap_modifier(self):
        from axplug.api.config import make_modifier

        return make_modifier("dpo:simpo")
