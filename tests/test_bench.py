"""The bench/ scripts: equal-loss check across axplug, plain JAX and Flax NNX; LoC output;
the GPU script's arguments; start-up without jax."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import jax
import numpy as np
import pytest

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench")
sys.path.insert(0, BENCH)

import gpu_step_time  # noqa: E402
import loc_complexity  # noqa: E402
import plain_llama  # noqa: E402
import step_time  # noqa: E402

TINY = (
    "model.decoder.dim=32",
    "model.decoder.transformer.num_layers=2",
    "model.decoder.transformer.layer.attention.num_heads=4",
    "model.decoder.transformer.layer.feed_forward.hidden_dim=64",
    "input.seq_len=16",
    "input.batch_size=8",  # the axplug side shards it over the 8 test devices
)


def _sides(shape: str, flax: bool):
    cfg = step_time.shape_config(shape, TINY)
    sides = step_time.make_sides(cfg, flax=flax)
    params = sides[0].init()
    for side in sides[1:]:
        side.set_params(params)
    host = [cfg.input.instantiate().batch(i) for i in range(3)]
    # A host copy: the axplug side donates (deletes) its parameters when it steps.
    params = jax.tree.map(np.array, params)
    return cfg, sides, params, {s.name: [s.put(h) for h in host] for s in sides}


def _reference_loss(params, spec, batch) -> float:
    """Cross entropy of the plain model in float64 numpy on the first batch (no MoE)."""
    p = jax.tree.map(lambda x: np.asarray(x, np.float64), params)
    ids, labels = np.asarray(batch["input_ids"]), np.asarray(batch["target_labels"])
    x = p["embed"][ids]
    s, hd = ids.shape[1], spec.dim // spec.heads
    freqs = 1.0 / spec.rope_theta ** (np.arange(0, hd, 2) / hd)
    ang = np.arange(s)[:, None] * freqs
    cos, sin = np.cos(ang)[None, :, None], np.sin(ang)[None, :, None]

    def rms(v, scale):
        return v / np.sqrt(np.mean(v * v, -1, keepdims=True) + spec.norm_eps) * scale

    def rope(v):
        a, b = v[..., : hd // 2], v[..., hd // 2 :]
        return np.concatenate([a * cos - b * sin, b * cos + a * sin], -1)

    for lp in p["layers"]:
        h = rms(x, lp["attn_norm"]["scale"])
        q, k, v = ((h @ lp[w]).reshape(*ids.shape, spec.heads, hd) for w in ("wq", "wk", "wv"))
        q, k = rope(q), rope(k)
        logits = np.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(hd)
        logits = np.where(np.tril(np.ones((s, s), bool)), logits, -1e30)
        probs = np.exp(logits - logits.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        x = x + np.einsum("bhqk,bkhd->bqhd", probs, v).reshape(x.shape) @ lp["wo"]
        h = rms(x, lp["mlp_norm"]["scale"])
        gate = h @ lp["w_gate"]
        x = x + (gate / (1 + np.exp(-gate)) * (h @ lp["w_up"])) @ lp["w_down"]
    logits = rms(x, p["final_norm"]["scale"]) @ p["lm_head"]
    lse = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1)
    nll = lse - np.take_along_axis(logits, labels[..., None], -1)[..., 0]
    return float(nll[labels >= 0].mean())


def test_three_sides_same_loss_as_an_independent_reference():
    pytest.importorskip("flax")
    cfg, sides, params, batches = _sides("llama-tiny", flax=True)
    assert [s.name for s in sides] == ["axplug", "plain-jax", "flax-nnx"]
    spec = plain_llama.spec_from_config(cfg)
    expected = _reference_loss(sides[1].layout(params), spec, batches["plain-jax"][0])
    ok, text = step_time.check_losses(sides, batches, 2, 1e-5)
    assert ok, text
    first = float(text.split("plain-jax ")[1].split(";")[0])
    assert first == pytest.approx(expected, rel=1e-5)

    # The check fails when one side computes something else.
    bad = jax.tree.map(lambda x: x * 1.5, params)
    sides[2].set_params(bad)
    ok, text = step_time.check_losses(sides, batches, 2, 1e-5)
    assert not ok and "MISMATCH" in text


def test_moe_sides_agree_and_include_aux_losses():
    cfg, sides, _, batches = _sides("moe-tiny", flax=False)
    spec = plain_llama.spec_from_config(cfg)
    assert spec.experts == 8 and spec.top_k == 2 and spec.load_balance_coefficient > 0
    outs = {s.name: s.step(batches[s.name][0]) for s in sides}
    metrics = outs["axplug"][1]
    ce = float(metrics["ce_loss"])
    aux = float(metrics["load_balance_loss"]) + float(metrics["router_z_loss"])
    assert sides[1].loss(outs["plain-jax"]) == pytest.approx(ce + aux, rel=1e-5)
    assert aux > 0.005  # balance alone is about coefficient x 1.0


def test_unsupported_features_are_named():
    cfg = step_time.shape_config("llama-tiny", TINY)
    from axplug.modifiers import make_modifier

    scanned = make_modifier("scan_layers")(cfg)
    with pytest.raises(ValueError, match="transformer RepeatedTransformer"):
        plain_llama.spec_from_config(scanned)


def test_bfloat16_compute_agrees_loosely():
    cfg = step_time.shape_config("llama-tiny", (*TINY, "model.compute_dtype='bfloat16'"))
    sides = step_time.make_sides(cfg, flax=False)
    params = sides[0].init()
    sides[1].set_params(params)
    host = cfg.input.instantiate().batch(0)
    batches = {s.name: [s.put(host)] * 2 for s in sides}
    ok, text = step_time.check_losses(sides, batches, 2, step_time.LOSS_RTOL["bfloat16"])
    assert ok, text


def test_loc_counts_and_table(capsys):
    assert loc_complexity.count_changed_lines("a\nb\n", "a\nb\nc\n") == (1, 0)
    assert loc_complexity.count_changed_lines("a\nb\n", "a\nx\n") == (1, 1)
    assert loc_complexity.variant_specs("llama-tiny", "rope") == []
    assert loc_complexity.variant_specs("gpt-tiny", "rope") == ["rope"]
    assert loc_complexity.variant_specs("llama-tiny", "moe") == ["moe:num_experts=8,top_k=2"]
    if shutil.which("git") is None or not os.path.isdir(os.path.join(BENCH, "..", ".git")):
        pytest.skip("needs the git history")
    assert loc_complexity.main([]) == 0
    out = capsys.readouterr().out.splitlines()
    rows = {line.split()[0]: line.split()[1:] for line in out if line.split()}
    assert rows["gpt-tiny"][:2] == ["1", "1"]
    assert rows["llama-tiny"][:3] == ["0", "(has)", "1"]
    for dist in loc_complexity.PLUGINS:
        commit, plus, minus = rows[dist][:3]
        assert len(commit) >= 7 and plus.isdigit() and minus.isdigit()
    # A family that needs no new layer is one contribution and 0 core lines (main's last
    # table, family_lines()'s rows: read from the output, not asked of git a second time).
    for name in ("MistralForCausalLM", "Qwen2ForCausalLM", "Phi3ForCausalLM"):
        if name in rows:
            dist, lines, plus, minus = rows[name]
            assert dist == "axplug-models" and 0 < int(lines) < 80 and (plus, minus) == ("0", "0")
    # The vision families after the first: 0 core lines; the mechanism's cost is reported.
    for name in ("Gemma3ForConditionalGeneration", "Qwen2_5_VLForConditionalGeneration"):
        if name in rows:
            assert rows[name][0] == "axplug-vision" and rows[name][2:] == ["0", "0"]
    if "LlavaForConditionalGeneration" in rows:  # axplug-vision installed
        commits, plus, minus, *families = rows["axplug-vision"]
        families = [f.rstrip(",") for f in families]
        assert int(commits) > 1 and int(plus) > 0 and "LlavaForConditionalGeneration" in families


def test_gpu_script_arguments_and_cpu_refusal(capsys):
    args = gpu_step_time.parse_args([])
    d, layers, h, v = args.dim, args.layers, args.hidden, args.vocab
    params = layers * (4 * d * d + 3 * d * h + 2 * d) + 2 * v * d + d
    assert 0.9e9 < params < 1.1e9
    cfg = step_time.shape_config("llama-tiny", gpu_step_time.overrides(args))
    spec = plain_llama.spec_from_config(cfg)
    assert (spec.dim, spec.layers, spec.hidden, spec.vocab) == (d, layers, h, v)
    assert spec.compute_dtype == "bfloat16"
    assert gpu_step_time.device_spec("NVIDIA H200").peak_bf16_flops > 0
    with pytest.raises(SystemExit):
        gpu_step_time.parse_args(["--dim", "100", "--heads", "16"])
    with pytest.raises(SystemExit, match="device-spec"):
        gpu_step_time.device_spec("Some GPU")
    assert gpu_step_time.main([]) == 2
    assert "needs a GPU" in capsys.readouterr().err


def test_axplug_list_does_not_import_jax():
    import startup

    proc = subprocess.run(startup.COMMANDS["axplug list"], capture_output=True, text=True)
    assert proc.returncode == 0 and "presets" in proc.stdout
    assert not startup.imports_jax(startup.COMMANDS["axplug list"])


def test_axplug_step_reads_the_bytes_a_plain_jax_step_reads():
    """The compiled steps on one device: the module system, context and the non-finite guard
    add no memory traffic beyond the guard's branch (a few scalars), and no FLOPs."""
    cfg = step_time.shape_config("llama-tiny", TINY)
    trainer = cfg.instantiate(devices=jax.devices()[:1])
    token = jax.ShapeDtypeStruct((8, 16), np.int32, sharding=trainer.batch_sharding)
    batch = {"input_ids": token, "target_labels": token}
    ours = trainer._train_step.lower(trainer.layout.abstract, batch).compile()
    plain = step_time.PlainSide(cfg)
    plain.set_params(trainer.init_state()["params"])
    theirs = plain.jitted.lower(*plain.abstract_args()).compile()
    a, b = (step_time.compiled_stats(c) for c in (ours, theirs))
    assert abs(a["gbytes_accessed"] - b["gbytes_accessed"]) * 1e9 <= 8192, (a, b)
    assert a["gflops"] == pytest.approx(b["gflops"], rel=1e-3)
    assert a["temp_mb"] == pytest.approx(b["temp_mb"], rel=1e-2)
