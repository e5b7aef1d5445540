"""Hugging Face LLaMA / Mixtral import: logits against a plain-numpy forward pass of the HF math,
the trainer's checkpoint layout, and errors that name the field or tensor."""

import json
import os

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import save_file

from axplug.checkpoint import Checkpointer
from axplug.cli import main
from axplug.config import from_dict
from axplug.context import functional
from axplug.interop import (
    HFImportError,
    SafetensorsDir,
    hf_params,
    hf_trainer_config,
    import_hf,
    parse_hf_config,
    read_hf_config,
)
from axplug.modifiers import make_modifier
from axplug.trainer.fresh_optimizer import restore_train_state

# --- small HF checkpoints, written the way transformers names and shapes them ---------------


def llama_config(**updates) -> dict:
    cfg = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": 96,
        "hidden_size": 32,
        "intermediate_size": 48,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "rope_scaling": None,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "max_position_embeddings": 64,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "torch_dtype": "float32",
    }
    return {**cfg, **updates}


def mixtral_config(**updates) -> dict:
    cfg = llama_config(
        architectures=["MixtralForCausalLM"],
        model_type="mixtral",
        num_local_experts=4,
        num_experts_per_tok=2,
        router_aux_loss_coef=0.02,
        router_jitter_noise=0.0,
        sliding_window=None,
        rope_theta=1e6,
    )
    for key in ("attention_bias", "mlp_bias"):
        cfg.pop(key)
    return {**cfg, **updates}


def _head_dim(cfg):
    return cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]


def hf_weights(cfg: dict, seed: int = 0) -> dict:
    """Random weights under HF's parameter names and [out, in] shapes, scaled so attention is
    peaked (RoPE and masking errors show in the logits)."""
    rng = np.random.default_rng(seed)
    d, h, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    hd = _head_dim(cfg)
    q_dim, kv_dim = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd

    def lin(out_dim, in_dim, gain=1.0):
        return (gain * rng.standard_normal((out_dim, in_dim)) / np.sqrt(in_dim)).astype(np.float32)

    def norm():
        return (1.0 + 0.2 * rng.standard_normal(d)).astype(np.float32)

    w = {"model.embed_tokens.weight": rng.standard_normal((v, d)).astype(np.float32)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}"
        w[f"{p}.input_layernorm.weight"] = norm()
        w[f"{p}.self_attn.q_proj.weight"] = lin(q_dim, d, 2.0)
        w[f"{p}.self_attn.k_proj.weight"] = lin(kv_dim, d, 2.0)
        w[f"{p}.self_attn.v_proj.weight"] = lin(kv_dim, d)
        w[f"{p}.self_attn.o_proj.weight"] = lin(d, q_dim)
        w[f"{p}.post_attention_layernorm.weight"] = norm()
        if "num_local_experts" in cfg:
            moe = f"{p}.block_sparse_moe"
            w[f"{moe}.gate.weight"] = lin(cfg["num_local_experts"], d, 3.0)
            for j in range(cfg["num_local_experts"]):
                w[f"{moe}.experts.{j}.w1.weight"] = lin(h, d)
                w[f"{moe}.experts.{j}.w2.weight"] = lin(d, h)
                w[f"{moe}.experts.{j}.w3.weight"] = lin(h, d)
        else:
            w[f"{p}.mlp.gate_proj.weight"] = lin(h, d)
            w[f"{p}.mlp.up_proj.weight"] = lin(h, d)
            w[f"{p}.mlp.down_proj.weight"] = lin(d, h)
    w["model.norm.weight"] = norm()
    if not cfg.get("tie_word_embeddings"):
        w["lm_head.weight"] = lin(v, d, 2.0)
    return w


def write_hf(directory, cfg: dict, weights: dict, *, shards: int = 1, dtype=None) -> str:
    """config.json + model.safetensors, or `shards` files with model.safetensors.index.json."""
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(cfg, f)
    if dtype is not None:
        weights = {k: v.astype(dtype) for k, v in weights.items()}
    names = sorted(weights)
    if shards == 1:
        save_file(weights, os.path.join(directory, "model.safetensors"))
        return str(directory)
    weight_map = {}
    for s in range(shards):
        file = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: weights[n] for n in names[s::shards]}
        save_file(part, os.path.join(directory, file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, file))
    with open(os.path.join(directory, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": 0}, "weight_map": weight_map}, f)
    return str(directory)


# --- the Hugging Face LLaMA / Mixtral forward pass, in float64 numpy -------------------------


def _rms_norm(x, weight, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * weight


def _inv_freq(cfg):
    hd = _head_dim(cfg)
    inv = 1.0 / cfg["rope_theta"] ** (np.arange(0, hd, 2) / hd)
    scaling = cfg.get("rope_scaling")
    if scaling:  # transformers' _compute_llama3_parameters
        factor, old = scaling["factor"], scaling["original_max_position_embeddings"]
        low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
        wavelen = 2 * np.pi / inv
        scaled = np.where(wavelen > old / low, inv / factor, inv)
        smooth = (old / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < old / high) & ~(wavelen > old / low)
        inv = np.where(medium, smoothed, scaled)
    return inv


def _rotate_half(x):
    half = x.shape[-1] // 2
    return np.concatenate([-x[..., half:], x[..., :half]], axis=-1)


def _rope(x, inv_freq):
    # x: [seq, heads, head_dim]; HF: emb = cat(freqs, freqs); x * cos + rotate_half(x) * sin
    freqs = np.arange(x.shape[0])[:, None] * inv_freq[None]
    emb = np.concatenate([freqs, freqs], axis=-1)[:, None, :]
    return x * np.cos(emb) + _rotate_half(x) * np.sin(emb)


def _silu(x):
    return x / (1.0 + np.exp(-x))


def _softmax(x):
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def _attention(cfg, w, p, x):
    s, hd = x.shape[0], _head_dim(cfg)
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    q = (x @ w[f"{p}.q_proj.weight"].T).reshape(s, heads, hd)
    k = (x @ w[f"{p}.k_proj.weight"].T).reshape(s, kv_heads, hd)
    v = (x @ w[f"{p}.v_proj.weight"].T).reshape(s, kv_heads, hd)
    inv = _inv_freq(cfg)
    q, k = _rope(q, inv), _rope(k, inv)
    k, v = np.repeat(k, heads // kv_heads, axis=1), np.repeat(v, heads // kv_heads, axis=1)
    scores = np.einsum("qhd,khd->hqk", q, k) / np.sqrt(hd)
    scores = np.where(np.tril(np.ones((s, s), bool)), scores, -np.inf)
    out = np.einsum("hqk,khd->qhd", _softmax(scores), v).reshape(s, heads * hd)
    return out @ w[f"{p}.o_proj.weight"].T


def _mlp(w, p, x):
    gate, up = x @ w[f"{p}.gate_proj.weight"].T, x @ w[f"{p}.up_proj.weight"].T
    return (_silu(gate) * up) @ w[f"{p}.down_proj.weight"].T


def _mixtral_moe(cfg, w, p, x):
    # HF: softmax over all experts, top-k, renormalize the k weights.
    probs = _softmax(x @ w[f"{p}.gate.weight"].T)
    top = np.argsort(-probs, axis=-1)[:, : cfg["num_experts_per_tok"]]
    out = np.zeros_like(x)
    for t in range(x.shape[0]):
        gates = probs[t, top[t]] / probs[t, top[t]].sum()
        for gate, j in zip(gates, top[t], strict=True):
            e = f"{p}.experts.{j}"
            h = _silu(x[t] @ w[f"{e}.w1.weight"].T) * (x[t] @ w[f"{e}.w3.weight"].T)
            out[t] += gate * (h @ w[f"{e}.w2.weight"].T)
    return out


def hf_logits(cfg: dict, weights: dict, ids: np.ndarray) -> np.ndarray:
    w = {k: v.astype(np.float64) for k, v in weights.items()}
    eps = cfg["rms_norm_eps"]
    out = []
    for row in ids:
        x = w["model.embed_tokens.weight"][row]
        for i in range(cfg["num_hidden_layers"]):
            p = f"model.layers.{i}"
            x = x + _attention(
                cfg, w, f"{p}.self_attn", _rms_norm(x, w[f"{p}.input_layernorm.weight"], eps)
            )
            h = _rms_norm(x, w[f"{p}.post_attention_layernorm.weight"], eps)
            if "num_local_experts" in cfg:
                x = x + _mixtral_moe(cfg, w, f"{p}.block_sparse_moe", h)
            else:
                x = x + _mlp(w, f"{p}.mlp", h)
        x = _rms_norm(x, w["model.norm.weight"], eps)
        head = (
            w["model.embed_tokens.weight"]
            if cfg.get("tie_word_embeddings")
            else w["lm_head.weight"]
        )
        out.append(x @ head.T)
    return np.stack(out)


# --- loading the imported run the way a trained run is loaded ---------------------------------


def load_run(run_dir, devices=None):
    """(trainer, step, state, metadata): config from the checkpoint metadata, then the state
    the trainer resumes with (an import's fresh optimizer state created)."""
    directory = f"{run_dir}/checkpoints"
    with Checkpointer.default_config().set(directory=directory).instantiate() as checkpointer:
        step = checkpointer.latest_step()
        metadata = checkpointer.metadata(step)
    cfg = from_dict(metadata["config"]).clone(compilation_cache_dir=None, summary_writers=[])
    trainer = cfg.instantiate(devices=devices)
    step, state, _ = restore_train_state(trainer.checkpointer, trainer.layout, step)
    return trainer, step, state, metadata


def predict(model, params, ids):
    @jax.jit
    def logits(params, ids):
        return functional(
            model, prng_key=None, state=params, inputs=(ids,), is_training=False, method="predict"
        )[0]

    return np.asarray(logits(params, jnp.asarray(ids)), np.float64)


# A run laid out on one device: where the mesh is not the claim (the first test imports over
# the session's 8 fake devices), its loads, predictions and `axplug generate` cost about half.
ONE_DEVICE = ["mesh.mesh_shape=(1,1,1,1,1)"]

IDS = np.array(
    [[3, 17, 42, 5, 88, 11, 60, 2, 9, 33, 71, 14], [50, 1, 7, 95, 23, 23, 4, 66, 30, 8, 0, 12]]
)
TOL = dict(rtol=1e-4, atol=1e-4)


# --- imports that must reproduce the HF logits ------------------------------------------------


def test_llama_gqa_sharded_import_through_the_cli_matches_hf_math(tmp_path, capsys):
    cfg = llama_config()
    weights = hf_weights(cfg)
    src = write_hf(tmp_path / "hf", cfg, weights, shards=2)
    out = str(tmp_path / "run")

    assert main(["import-hf", src, "--output", out]) == 0
    printed = capsys.readouterr().out
    assert "LlamaForCausalLM" in printed
    assert "num_kv_heads: 2" in (tmp_path / "run" / "config.txt").read_text()

    trainer, step, state, metadata = load_run(out)
    assert step == 0 and metadata["source"]["architecture"] == "LlamaForCausalLM"
    assert metadata["source"]["config"]["eos_token_id"] == 2
    with open(f"{out}/config.txt") as f:
        assert (
            f.read() == hf_trainer_config(read_hf_config(src), output_dir=out).debug_string() + "\n"
        )
    layer = metadata["config"]["model"]["decoder"]["transformer"]["layer"]
    assert layer["attention"]["qkv"]["num_kv_heads"] == 2
    assert trainer.model.decoder.transformer.layer1 is not None  # unrolled stack

    expected = hf_logits(cfg, weights, IDS)
    np.testing.assert_allclose(predict(trainer.model, state["params"], IDS), expected, **TOL)

    # The trainer itself resumes from the import (fresh optimizer state at step 0).
    resumed = trainer.restore_or_init()
    assert int(resumed["step"]) == 0
    np.testing.assert_array_equal(
        np.asarray(resumed["params"]["decoder"]["embedding"]["weight"]),
        weights["model.embed_tokens.weight"],
    )
    trainer.checkpointer.close()

    # The same weights under the interleaved RoPE layout give other logits: the test can tell.
    wrong_cfg = make_modifier("rope:theta=10000.0,interleaved=True")(from_dict(metadata["config"]))
    wrong = wrong_cfg.model.instantiate(parent=None)
    assert np.abs(predict(wrong, state["params"], IDS) - expected).max() > 1e-2

    # A second import into the same run directory is refused.
    assert main(["import-hf", src, "--output", out]) == 2
    assert "already holds checkpoint step(s) 0" in capsys.readouterr().err


def test_tied_llama3_rope_scaling_head_dim_import_into_a_scanned_stack(tmp_path):
    cfg = llama_config(
        num_key_value_heads=4,
        head_dim=12,
        tie_word_embeddings=True,
        rms_norm_eps=1e-6,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    )
    weights = hf_weights(cfg, seed=1)
    src = write_hf(tmp_path / "hf", cfg, weights)
    out = str(tmp_path / "run")

    result = import_hf(src, out, modifiers=["scan_layers"], devices=jax.devices()[:1])
    assert not any(m.startswith("gqa") for m in result.modifiers)  # as many kv heads as heads

    trainer, _, state, _ = load_run(out, devices=jax.devices()[:1])
    scanned = state["params"]["decoder"]["transformer"]["layer"]
    assert scanned["attention"]["qkv"]["q"]["weight"].shape == (2, 32, 48)  # [layers, in, out]
    assert "lm_head" not in state["params"]["decoder"]
    np.testing.assert_allclose(
        predict(trainer.model, state["params"], IDS), hf_logits(cfg, weights, IDS), **TOL
    )
    trainer.checkpointer.close()


def test_mixtral_import_matches_hf_top_k_routing(tmp_path, capsys):
    cfg = mixtral_config()
    weights = hf_weights(cfg, seed=2)
    src = write_hf(tmp_path / "hf", cfg, weights)
    out = str(tmp_path / "run")

    result = import_hf(src, out, overrides=ONE_DEVICE)  # loaded and generated on one device too
    moe = result.config.model.decoder.transformer.layer.feed_forward
    assert (moe.num_experts, moe.router.top_k, moe.router.capacity_factor) == (4, 2, None)
    assert moe.router.load_balance_coefficient == pytest.approx(0.04)  # HF counts all k choices

    trainer, _, state, _ = load_run(out)
    experts = state["params"]["decoder"]["transformer"]["layer1"]["feed_forward"]
    np.testing.assert_array_equal(
        np.asarray(experts["wo"][3]),
        weights["model.layers.1.block_sparse_moe.experts.3.w2.weight"].T,
    )
    np.testing.assert_allclose(
        predict(trainer.model, state["params"], IDS), hf_logits(cfg, weights, IDS), **TOL
    )
    trainer.checkpointer.close()

    # `axplug generate` on the import continues a prompt as greedy decoding of the HF math does.
    tokens = [3, 17, 42, 5]
    prompt = list(tokens)
    for _ in range(5):
        tokens.append(int(np.argmax(hf_logits(cfg, weights, np.array([tokens]))[0, -1])))
    args = ["generate", "--checkpoint", out, "--prompt-ids", "3,17,42,5", "--json"]
    assert main([*args, "--temperature", "0", "--max-new-tokens", "5"]) == 0
    assert json.loads(capsys.readouterr().out) == {"prompt_ids": prompt, "output_ids": tokens[4:]}


def test_bfloat16_checkpoint_loads_exactly_and_computes_in_bfloat16(tmp_path):
    cfg = llama_config(torch_dtype="bfloat16")
    weights = hf_weights(cfg, seed=3)
    src = write_hf(tmp_path / "hf", cfg, weights, dtype=ml_dtypes.bfloat16)
    hf = read_hf_config(src)
    trainer_cfg = hf_trainer_config(hf, output_dir=str(tmp_path / "run"))
    assert trainer_cfg.model.compute_dtype == "bfloat16"
    specs = trainer_cfg.model.instantiate(parent=None).create_parameter_specs_recursively()
    from axplug.interop.hf_config import load_architecture

    rules = load_architecture(hf.architecture).tensors(trainer_cfg.model)
    with SafetensorsDir(src) as tensors:
        params = hf_params(tensors, rules, specs)
    q = params["decoder"]["transformer"]["layer0"]["attention"]["qkv"]["q"]["weight"]
    assert q.dtype == np.float32
    bf16 = weights["model.layers.0.self_attn.q_proj.weight"].astype(ml_dtypes.bfloat16)
    np.testing.assert_array_equal(q, bf16.astype(np.float32).T)


# --- errors -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "make, updates, expected",
    [
        (
            llama_config,
            {"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}},
            "rope_scaling.rope_type='dynamic'",
        ),
        (llama_config, {"hidden_act": "xielu"}, "hidden_act='xielu'"),
        (llama_config, {"attention_dropout": 0.1}, "attention_dropout=0.1"),
        (llama_config, {"my_knob": 3}, "field(s) my_knob=3 are read by no layer"),
        (llama_config, {"layer_types": ["sliding_attention", "full_attention"]}, "layer_types"),
        (llama_config, {"quantization_config": {"quant_method": "gptq"}}, "quantization_config"),
        (llama_config, {"architectures": ["FooForCausalLM"]}, "no installed plugin registers"),
        (llama_config, {"num_key_value_heads": 3}, "num_key_value_heads=3 does not divide"),
        (mixtral_config, {"num_experts_per_tok": 5}, "num_experts_per_tok=5 exceeds"),
    ],
)
def test_unsupported_config_fields_fail_with_their_names(make, updates, expected, tmp_path):
    with pytest.raises(HFImportError) as info:
        hf_trainer_config(parse_hf_config(make(**updates)), output_dir=str(tmp_path))
    assert expected in str(info.value)


def test_every_unsupported_field_is_named_at_once(tmp_path):
    raw = llama_config(hidden_act="xielu", attention_dropout=0.5, rope_theta=-1, extra_knob=3)
    with pytest.raises(HFImportError) as info:
        hf_trainer_config(parse_hf_config(raw), output_dir=str(tmp_path))
    for named in ("hidden_act='xielu'", "attention_dropout=0.5", "rope_theta=-1", "extra_knob=3"):
        assert named in str(info.value)


def test_an_unregistered_architecture_is_refused_before_jax_is_imported(tmp_path):
    """`import-hf` reads config.json and finds no plugin for it without importing jax."""
    import subprocess
    import sys

    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text(
        json.dumps(llama_config(architectures=["Gemma2ForCausalLM"]))
    )
    code = (
        "import sys\nfrom axplug.cli import main\n"
        f"rc = main(['import-hf', {str(tmp_path / 'hf')!r}, "
        f"'--output', {str(tmp_path / 'run')!r}])\n"
        "assert 'jax' not in sys.modules, 'jax was imported'\nsys.exit(rc)"
    )
    env = {**os.environ, "AXPLUG_DISABLE_PLUGINS": "axplug-models"}  # as if not installed
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert proc.returncode == 2, proc.stderr
    assert "Gemma2ForCausalLM is in axplug-models, which is disabled" in proc.stderr
    assert not (tmp_path / "run").exists()


def test_cli_reports_unsupported_field_and_writes_nothing(tmp_path, capsys):
    cfg = llama_config(hidden_act="xielu")
    src = write_hf(tmp_path / "hf", cfg, hf_weights(cfg))
    assert main(["import-hf", src, "--output", str(tmp_path / "run")]) == 2
    assert "hidden_act='xielu'" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


def _import_error(tmp_path, cfg, weights) -> str:
    src = write_hf(tmp_path / "hf", cfg, weights)
    out = tmp_path / "run"
    with pytest.raises(HFImportError) as info:
        import_hf(src, str(out))
    assert not (out / "config.txt").exists()
    assert not os.listdir(out / "checkpoints") if (out / "checkpoints").exists() else True
    return str(info.value)


def test_missing_tensor_is_named(tmp_path):
    cfg = llama_config()
    weights = hf_weights(cfg)
    del weights["model.layers.1.mlp.up_proj.weight"]
    message = _import_error(tmp_path, cfg, weights)
    assert "tensor 'model.layers.1.mlp.up_proj.weight' is missing" in message


def test_shape_mismatch_is_named_with_both_shapes(tmp_path):
    cfg = llama_config()
    weights = hf_weights(cfg)
    weights["model.layers.0.self_attn.k_proj.weight"] = np.zeros((32, 32), np.float32)
    message = _import_error(tmp_path, cfg, weights)
    assert "'model.layers.0.self_attn.k_proj.weight' gives [32, 32]" in message
    assert "decoder.transformer.layer0.attention.qkv.k.weight" in message
    assert "expects shape [32, 16]" in message


def test_tensor_without_a_place_is_named(tmp_path):
    cfg = llama_config()
    weights = hf_weights(cfg)
    weights["model.layers.0.self_attn.q_norm.weight"] = np.ones(8, np.float32)
    weights["model.layers.0.self_attn.rotary_emb.inv_freq"] = np.ones(4, np.float32)  # ignored
    message = _import_error(tmp_path, cfg, weights)
    assert "1 tensor(s)" in message and "model.layers.0.self_attn.q_norm.weight" in message


def test_missing_plugin_names_the_package(tmp_path, monkeypatch):
    from axplug import registry

    monkeypatch.setenv("AXPLUG_DISABLE_PLUGINS", "axplug-moe")
    registry.reset()
    try:
        with pytest.raises(HFImportError, match="MixtralForCausalLM is in axplug-moe"):
            parse_hf_config(mixtral_config())
        for arch in ("Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM"):
            with pytest.raises(HFImportError, match=f"{arch} is in axplug-moe, which is disabled"):
                parse_hf_config(mixtral_config(architectures=[arch]))
    finally:
        monkeypatch.delenv("AXPLUG_DISABLE_PLUGINS")
        registry.reset()


def test_rope_parameters_form_equals_rope_theta_and_rope_scaling():
    scaling = {
        "rope_type": "llama3",
        "factor": 32.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }

    def position(raw):
        cfg = hf_trainer_config(parse_hf_config(raw), output_dir="unused")
        return cfg.model.decoder.transformer.layer.attention.position

    old = position(llama_config(rope_theta=500000.0, rope_scaling=scaling))
    new_cfg = llama_config(rope_parameters={**scaling, "rope_theta": 500000.0})
    del new_cfg["rope_theta"], new_cfg["rope_scaling"]
    assert position(new_cfg).to_dict() == old.to_dict()
    assert (old.theta, old.scaling_factor) == (500000.0, 32.0)


def test_print_config_shows_the_imported_config_and_writes_nothing(tmp_path, capsys):
    cfg = mixtral_config()
    src = write_hf(tmp_path / "hf", cfg, hf_weights(cfg))
    out = tmp_path / "run"
    assert main(["import-hf", src, "--output", str(out), "--print-config"]) == 0
    lines = capsys.readouterr().out.splitlines()
    prefix = "model.decoder.transformer.layer.feed_forward"
    assert f"{prefix}.router.top_k: 2" in lines and f"{prefix}.num_experts: 4" in lines
    assert "model.decoder.transformer.layer.attention.qkv.num_kv_heads: 2" in lines
    assert "model.decoder.transformer.layer.norm.eps: 1e-05" in lines
    assert not out.exists()


@pytest.mark.parametrize(
    "modifiers, overrides, expected",
    [
        (
            (),
            ["model.decoder.transformer.layer.feed_forward.hidden_dim=64"],
            "expects shape [32, 64]",
        ),
        (("moe:num_experts=2",), (), "feed_forward.router.weight"),
    ],
    ids=["override", "modifier"],
)
def test_changes_that_no_longer_fit_the_weights_are_named(tmp_path, modifiers, overrides, expected):
    cfg = llama_config()
    src = write_hf(tmp_path / "hf", cfg, hf_weights(cfg))
    with pytest.raises(HFImportError, match="changed") as info:
        import_hf(src, str(tmp_path / "run"), modifiers=modifiers, overrides=overrides)
    assert expected in str(info.value)
    assert not (tmp_path / "run" / "config.txt").exists()


def word_tokenizer(directory, vocab_size: int) -> list[str]:
    """A word-level tokenizer.json of `vocab_size` tokens (`</s>` the EOS) and its config."""
    pytest.importorskip("tokenizers")
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    words = ["<unk>", "<s>", "</s>"] + [f"w{i}" for i in range(vocab_size - 5)] + ["to", "be"]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text('{"eos_token": "</s>", "bos_token": "<s>"}')
    return words


def test_import_copies_the_tokenizer_and_generate_speaks_text(tmp_path, capsys):
    cfg = llama_config()
    src = write_hf(tmp_path / "hf", cfg, hf_weights(cfg))
    word_tokenizer(tmp_path / "hf", cfg["vocab_size"])
    out = str(tmp_path / "run")
    assert main(["import-hf", src, "--output", out, "--set", *ONE_DEVICE]) == 0
    capsys.readouterr()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (tmp_path / "run" / name).read_bytes() == (tmp_path / "hf" / name).read_bytes()

    # 3 prompt tokens + 12 new: the engine's shapes of the stop-token test below (the same
    # model), so its programs are compiled once in a session.
    argv = ["generate", "--checkpoint", out, "--prompt", "to be w3", "--temperature", "0",
            "--max-new-tokens", "12"]  # fmt: skip
    assert main([*argv, "--json"]) == 0
    ids = json.loads(capsys.readouterr().out)
    assert ids["prompt_ids"] == [cfg["vocab_size"] - 2, cfg["vocab_size"] - 1, 6]
    expected = ids["output_ids"]
    assert 1 <= len(expected) <= 12 and 2 not in expected[:-1]  # stops at the EOS, if reached
    assert main(argv) == 0
    text = capsys.readouterr().out.strip()
    from axplug.tokenizer import load_tokenizer

    assert text == load_tokenizer(out).decode(ids["prompt_ids"] + expected)
    assert text.startswith("to be w3")


def test_stop_tokens_come_from_the_imported_models_eos_ids(tmp_path, capsys):
    """config.json's eos_token_id and generation_config.json's list (Llama 3 style) become the
    loaded model's stop tokens, through a fine-tune too; generation stops at them."""
    from axplug.inference import load_checkpoint
    from axplug.inference.loading import run_lineage, source_stop_tokens

    def imported(name, eos, generation_eos=None):
        cfg = llama_config(eos_token_id=eos)
        src = write_hf(tmp_path / f"hf-{name}", cfg, hf_weights(cfg))
        if generation_eos is not None:
            generation = {"eos_token_id": generation_eos}
            (tmp_path / f"hf-{name}" / "generation_config.json").write_text(json.dumps(generation))
        import_hf(src, str(tmp_path / name), overrides=ONE_DEVICE)
        return str(tmp_path / name)

    def greedy(run, *extra):
        args = ["generate", "--checkpoint", run, "--prompt-ids", "1,5,9", "--temperature", "0"]
        assert main([*args, "--max-new-tokens", "12", "--json", *extra]) == 0
        return json.loads(capsys.readouterr().out)["output_ids"]

    free = greedy(imported("free", None))  # no eos anywhere: 12 tokens
    assert len(free) == 12
    unused = next(t for t in range(96) if t not in free)
    stop = free[5]
    run = imported("eos", unused, [stop, unused])
    loaded = load_checkpoint(run)
    assert loaded.stop_tokens == (unused, stop)
    assert greedy(run) == free[: free.index(stop)]  # the same weights stop at the eos id
    assert greedy(run, "--stop", str(unused)) == free  # --stop replaces them
    # A run fine-tuned from the import inherits them (the lineage follows init_from).
    tuned = [(str(tmp_path / "tuned"), {"config": {"init_from": run}})]
    assert source_stop_tokens(tuned + run_lineage(run, 0)[:1]) == loaded.stop_tokens
    assert source_stop_tokens([("x", {"config": {}})]) == ()
