"""`axplug_aot` and `axplug aot`: compile a train step for a mesh rule without running it."""

from __future__ import annotations

import json
import subprocess
import sys

import jax
import pytest
from axplug_aot import command as aot_cmd
from axplug_aot import plan as aot_plan
from axplug_aot import report as aot
from axplug_testing import cli_main as main

from axplug.api import registry, run, sharding
from axplug.api.config import ConfigError

KEY = jax.random.PRNGKey(0)

NAMES = ("data", "fsdp", "expert", "seq", "model")
# One layer and short sequences keep each compile to a few seconds on two cores.
SMALL = ["--set=model.decoder.transformer.num_layers=1", "--set=input.seq_len=64"]


def _needs_gpu_plugin():
    if "gpu-h100-8xn" not in registry.names("mesh_rules"):
        pytest.skip("needs axplug-gpu installed and enabled")


def _run(*argv: str) -> int:
    return main(["aot", *argv])


@pytest.mark.parametrize(
    "selector, count",
    [("gpu-h100-8x32", 256), ("tpu-v5e-256", 256), ("cpu-8", 8), ("cpu", None), ("trn2-16", 16)],
)
def test_selector_device_count(selector, count):
    assert sharding.selector_device_count(selector) == count


def test_scale_down_divides_the_data_axis_and_batch():
    assert aot.scale_down((32, 8, 1, 1, 1), NAMES, 256, 64) == ((8, 8, 1, 1, 1), 64, 4)
    assert aot.scale_down((2, 4, 1, 1, 1), NAMES, 8, 8) == ((2, 4, 1, 1, 1), 8, 1)
    with pytest.raises(ConfigError, match="only the data axis"):
        aot.scale_down((1, 256, 1, 1, 1), NAMES, 256, 64)


def test_analytic_flops_is_6nd_plus_attention():
    flops = run.analytic_flops(1000, layers=2, dim=16, seq=8, batch=4)
    assert flops == 6 * 1000 * 32 + 12 * 2 * 16 * 8 * 32


def test_text_report_names_the_verdict():
    report = aot.AotReport(
        preset="p", rule="gpu-h100-8", selector="gpu-h100-8", device="H100", num_devices=16,
        compiled_devices=8, mesh_shape={"data": 2, "fsdp": 8}, compiled_mesh_shape={},
        scale_factor=2, params=7_000_000_000, active_params=2e9,
        memory=dict.fromkeys(("params", "optimizer", "batch", "temp"), 0) | {"total": 90 * aot.GIB},
        hbm_bytes=80 * aot.GIB, fits=False, flops_per_step_analytic=1e18,
        flops_per_step_xla=None, scanned_layers=True, tokens_per_step=1 << 20,
        peak_flops_per_device=989e12, target_mfu=0.4, step_time_at_target_mfu_s=158.0,
        notes=["n1"], collectives={"all-gather": 3},
    )  # fmt: skip
    text = aot_cmd.format_report(report)
    assert "7.00B params" in text and "data=2, fsdp=8" in text
    assert "would OOM by 10.00 GiB" in text and "data axis and batch / 2" in text
    assert "step time at 40% MFU: 158 s" in text and "note: n1" in text
    assert "2.00B params active per token" in text and "all-gather 3" in text


def test_device_spec_travels_with_the_rule():
    _needs_gpu_plugin()
    spec = sharding.device_spec_of("gpu-h100-8xn")
    assert spec.name.startswith("NVIDIA H100") and spec.peak_bf16_flops == 989e12
    assert sharding.device_spec_of("cpu") is None
    assert sharding.resolve_rule("gpu-h100-8x32")[0] == "gpu-h100-8xn"


def test_cpu_rule_json_report(capsys):
    code = _run("--preset", "gpt-tiny", "--mesh-rule", "cpu", "--json", *SMALL)
    assert code == 0
    report = json.loads(capsys.readouterr().out)
    assert report["rule"] == "cpu" and report["device"] is None and report["fits"] is None
    assert report["num_devices"] == report["compiled_devices"] == 8  # the test's fake devices
    mem = report["memory"]
    assert mem["total"] == mem["argument"] + mem["output"] + mem["temp"] - mem["alias"]
    assert (
        mem["temp"] > 0
        and mem["params"] > 0
        and mem["optimizer"] == pytest.approx(2 * mem["params"], rel=0.01)
    )
    # Unrolled layers: XLA's count and 6·N·D + attention agree to within a factor.
    ratio = report["flops_per_step_xla"] / report["flops_per_step_analytic"]
    assert 0.5 < ratio < 2.0


def test_gpu_rule_scaled_down_and_oom(capsys):
    _needs_gpu_plugin()
    # 16 GPUs (fsdp 8 x data 2) compiled on 8 fake devices, with a 1 MiB "HBM".
    argv = ["--preset", "gpt-tiny", "--mesh-rule", "gpu-h100-8x2", "--max-devices", "8"]
    argv += ["--hbm-gib", str(1 / 1024), "--step-time", "0.01", "--json", *SMALL]
    code = _run(*argv, "--set=input.batch_size=32")
    out, err = capsys.readouterr()
    assert code == aot_cmd.EXIT_OOM
    report = json.loads(out)
    assert report["num_devices"] == 16 and report["compiled_devices"] == 8
    assert report["scale_factor"] == 2
    assert report["compiled_mesh_shape"]["data"] == 1 and report["mesh_shape"]["data"] == 2
    assert report["tokens_per_step"] == 32 * 64  # the full global batch
    assert report["fits"] is False and report["over_bytes"] > 0
    assert report["scanned_layers"] is True
    assert "would OOM by" in err and "GiB" in err
    assert any("flash attention assumed" in note for note in report["notes"])
    per_device = report["flops_per_step_analytic"] / 16
    assert report["step_time_at_target_mfu_s"] == pytest.approx(per_device / (989e12 * 0.4))
    assert report["mfu_at_step_time"] == pytest.approx(per_device / (989e12 * 0.01))


def test_unknown_rule_is_a_clear_error(capsys):
    assert _run("--preset", "gpt-tiny", "--mesh-rule", "abacus-9") == 2
    assert "no installed mesh rule matches 'abacus-9'" in capsys.readouterr().err


def test_batch_that_the_mesh_cannot_split_is_a_clear_error(capsys):
    _needs_gpu_plugin()
    assert _run("--preset", "gpt-tiny", "--mesh-rule", "gpu-h100-8x2", *SMALL) == 2
    assert "input.batch_size 8 is not divisible by the 16 batch shards" in capsys.readouterr().err


@pytest.mark.slow
def test_reruns_itself_with_enough_fake_devices(tmp_path):
    """16 devices > the 8 this process has: the command re-executes with XLA_FLAGS set."""
    _needs_gpu_plugin()
    argv = ["--preset", "gpt-tiny", "--mesh-rule", "gpu-h100-8x2", "--json", *SMALL]
    argv += ["--set=input.batch_size=16"]
    proc = subprocess.run(
        [sys.executable, "-m", "axplug.cli", "aot", *argv],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["compiled_devices"] == 16 and report["scale_factor"] == 1


def test_llama2_7b_on_one_h100_host_plans_flash_attention_memory(capsys):
    # One 4096-token sequence per H100 with the rule's flash attention: CPU compiles plan the
    # blockwise kernel (O(seq) memory), not XLA's [b, h, s, s] scores (733 GiB before).
    _needs_gpu_plugin()
    code = _run(
        "--preset", "llama2-7b", "--mesh-rule", "gpu-h100-8", "--set=input.batch_size=8",
        "--json",
    )  # fmt: skip
    report = json.loads(capsys.readouterr().out)
    assert code == 0 and report["fits"] is True
    assert 12 * 2**30 < report["memory"]["total"] < 30 * 2**30, report["memory"]
    assert any("blockwise" in note for note in report["notes"])
    assert any("bfloat16 compiled as float16" in note for note in report["notes"])


def test_bfloat16_plans_as_float16_whose_scan_stacks_stay_two_bytes():
    """XLA:CPU widens a scanned bf16 stack to f32; the planned float16 one keeps 2 bytes."""
    from axplug.api.config import preset_config

    cfg = preset_config("llama-tiny").clone()
    cfg.model.compute_dtype = "bfloat16"
    planned, note = aot_plan.plan_bfloat16(cfg)
    assert planned.model.compute_dtype == "float16" and "model.compute_dtype" in note
    assert cfg.model.compute_dtype == "bfloat16"  # the caller's config is left alone
    assert aot_plan.plan_bfloat16(planned) == (planned, None)

    def temp_bytes(dtype):
        def loss(w, x):
            def layer(h, w):
                return jax.numpy.tanh(h @ w)

            saved = jax.checkpoint(layer, policy=jax.checkpoint_policies.dots_saveable)

            def body(h, w):
                return saved(h, w), None

            return jax.lax.scan(body, x, w)[0].astype("float32").sum()

        w, x = jax.ShapeDtypeStruct((8, 256, 256), dtype), jax.ShapeDtypeStruct((256, 256), dtype)
        return jax.jit(jax.grad(loss)).lower(w, x).compile().memory_analysis().temp_size_in_bytes

    # The saved dots and the stacked gradient: bf16 ones are widened, float16 ones are not.
    assert temp_bytes(jax.numpy.float16) < 0.6 * temp_bytes(jax.numpy.bfloat16)


def test_moe_flops_count_the_active_experts_only():
    # Mixtral 8x7B: 46.7B parameters, 12.9B active per token (2 of 8 experts).
    from axplug.api.config import preset_config

    cfg = preset_config("mixtral-8x7b")
    model = cfg.model.instantiate(parent=None, _path="model")
    active = run.active_parameters(model)
    assert active == pytest.approx(12.9e9, rel=0.01)
    tokens = cfg.input.batch_size * cfg.input.seq_len
    attention = 12 * 32 * 4096 * cfg.input.seq_len  # 12 * layers * dim * seq per token
    per_token = run.model_flops_per_step(cfg, model) / tokens
    assert per_token == pytest.approx(6 * 12.9e9 + attention, rel=0.10)
    # A dense model's active parameters are all of them.
    dense = preset_config("llama-tiny").model.instantiate(parent=None, _path="model")
    total = sum(x.size for x in jax.tree.leaves(dense.initialize_parameters_recursively(KEY)))
    assert run.active_parameters(dense) == total


# --- compile-only TPU topologies (libtpu) ------------------------------------------------------


@pytest.mark.parametrize(
    "selector, expected",
    [
        ("tpu-v5e-256", ("v5e:16x16", 1)),
        ("tpu-v5e-256x4", ("v5e:16x16", 4)),
        ("tpu-tpu-v5-lite-8", ("v5e:2x4", 1)),  # what detect_selector() gives on a v5e host
        ("tpu-v5p-512", ("v5p:8x8x8", 1)),  # selectors count chips (JAX devices)
        ("tpu-v4-32x2", ("v4:2x4x4", 2)),
        ("tpu-v6e-3", None),  # no such slice
        ("gpu-h100-8", None),
        ("tpu-v5e-slice", None),  # a rule name, not a selector
    ],
)
def test_tpu_topology_names(selector, expected):
    from axplug_aot.topology import tpu_topology_name

    assert tpu_topology_name(selector) == expected


def test_compile_only_devices_say_why_not(monkeypatch):
    from axplug_aot import topology

    assert topology.compile_only_devices("gpu", "gpu-h100-8", 8) == (
        None, "JAX has no compile-only gpu client",
    )  # fmt: skip
    assert "no TPU topology" in topology.compile_only_devices("tpu", "tpu-v6e-3", 3)[1]
    monkeypatch.setattr(topology, "libtpu_available", lambda: False)
    devices, why = topology.compile_only_devices("tpu", "tpu-v5e-16", 16)
    assert devices is None and "pip install libtpu" in why


def test_tpu_rule_compiles_on_the_topologys_devices_unscaled(monkeypatch, capsys):
    """The dispatch: compile-only devices are used as they are (no data-axis scaling, no
    fake-CPU planning), and the flash slots choose kernels for the target platform."""
    from axplug_aot import topology

    if "tpu-v5e-slice" not in registry.names("mesh_rules"):
        pytest.skip("needs axplug-tpu installed and enabled")
    asked, planned = [], []
    monkeypatch.setattr(
        topology,
        "compile_only_devices",
        lambda platform, selector, n: (
            asked.append((platform, selector, n)) or (jax.devices()[:n], "a stand-in topology")
        ),
    )
    monkeypatch.setattr(aot_plan, "kernels_for", lambda cfg, p: planned.append(p) or cfg)
    code = _run(
        "--preset", "gpt-tiny", "--mesh-rule", "tpu-v5e-8", "--max-devices", "2", "--json",
        *SMALL, "--set=input.batch_size=8", "--modifier", "mesh:fsdp=-1",
    )  # fmt: skip
    report = json.loads(capsys.readouterr().out)
    assert code == 0 and asked == [("tpu", "tpu-v5e-8", 8)] and planned == ["tpu"]
    assert report["compiled_devices"] == 8 and report["scale_factor"] == 1  # not scaled down
    assert report["notes"][0] == "compiled for a stand-in topology"
    assert not any("float16" in note or "blockwise" in note for note in report["notes"])


def test_real_tpu_topology_compile_with_libtpu(capsys):
    pytest.importorskip("libtpu")
    if "tpu-v5e-slice" not in registry.names("mesh_rules"):
        pytest.skip("needs axplug-tpu installed and enabled")
    code = _run(
        "--preset", "gpt-tiny", "--mesh-rule", "tpu-v5e-16", "--json", *SMALL,
        "--set=input.batch_size=16",
    )  # fmt: skip
    report = json.loads(capsys.readouterr().out)
    assert code == 0 and report["compiled_devices"] == 16
    assert report["notes"][0] == "compiled for TPU topology v5e:4x4 x1 (libtpu, compile-only)"


def test_collectives_are_counted_whatever_their_result_shape():
    # XLA prints a tuple of 6+ results with `/*index=5*/` comments before the op's name;
    # async pairs count once; metadata (`all_to_all`) and instruction names never count.
    hlo = "\n".join(
        [
            "  %a = (f32[2]{0}, f32[2]{0}, f32[2]{0}, f32[2]{0}, f32[2]{0}, /*index=5*/f32[2]{0})"
            " all-to-all(%p0, %p1, %p2, %p3, %p4, %p5), replica_groups={{0,1}}",
            '  %all-gather.1 = f32[4]{0} all-gather-start(%x), metadata={op_name="all_gather"}',
            "  %d = f32[4]{0} all-gather-done(%all-gather.1)",
            '  %r = f32[] all-reduce(%y), to_apply=%sum, metadata={op_name="jit/all_to_all"}',
        ]
    )
    assert aot.count_collectives(hlo) == {"all-gather": 1, "all-reduce": 1, "all-to-all": 1}


def test_dump_writes_the_steps_hlo_and_analysis(tmp_path, capsys):
    dump = tmp_path / "hlo"
    code = _run("--preset", "gpt-tiny", "--mesh-rule", "cpu", "--json", "--dump", str(dump), *SMALL)
    assert code == 0
    report = json.loads(capsys.readouterr().out)
    assert f"HLO and analysis of the compiled step written to {dump}" in report["notes"]
    hlo = (dump / "train_step.after_optimizations.hlo.txt").read_text()
    assert "ENTRY" in hlo and "HloModule jit_step" in hlo
    # Named scopes: the optimized ops' metadata names the module they came from.
    assert 'op_name="jit(step)/jvp(decoder)/transformer/layer0/attention/' in hlo
    mlir = (dump / "train_step.before_optimizations.mlir").read_text()
    assert "func.func public @main" in mlir and "stablehlo.dot_general" in mlir
    assert "ENTRY" not in mlir and "transformer/layer0/feed_forward" in mlir
    analysis = json.loads((dump / "train_step.analysis.json").read_text())
    assert analysis["memory_per_device_bytes"] == report["memory"]
    assert analysis["cost_analysis"]["flops"] * 8 == pytest.approx(report["flops_per_step_xla"])


def test_dump_is_passed_on_when_the_command_reruns_itself():
    import argparse

    parser = argparse.ArgumentParser()
    aot_cmd.add_parser(parser.add_subparsers())
    base = ["aot", "--preset", "gpt-tiny", "--mesh-rule", "cpu"]
    argv = aot_cmd._argv(parser.parse_args([*base, "--dump", "d"]))
    assert argv[argv.index("--dump") + 1] == "d"
    assert "--dump" not in aot_cmd._argv(parser.parse_args(base))
