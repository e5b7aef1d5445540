"""The hardware plugins (axplug-gpu, axplug-tpu, axplug-trainium): specs, mesh rules, kernel
gating through the core's real dispatch, with the backend name simulated. Their kernels under
sharded meshes (shard_map, lowering for TPU and CUDA) are in tests/test_kernel_sharding.py;
what concerns one plugin alone (NKI wiring, NVML, the TPU duty cycle) is in its tests/."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

axplug_gpu = pytest.importorskip("axplug_gpu")
axplug_tpu = pytest.importorskip("axplug_tpu")
axplug_trainium = pytest.importorskip("axplug_trainium")

from axplug_testing import abstract_call  # noqa: E402

from axplug import registry  # noqa: E402
from axplug.api import AttentionMask, DeviceSpec  # noqa: E402
from axplug.kernels import ReferenceKernel, kernel_choices, select_kernel  # noqa: E402
from axplug.mesh_rules import device_spec_of, select_mesh_rule  # noqa: E402
from axplug.modifiers import make_modifier  # noqa: E402

if not {"cudnn_flash", "splash", "nki_flash"} <= set(registry.names("kernels")):
    # Installed but not loaded (AXPLUG_LOAD_PLUGINS / AXPLUG_DISABLE_PLUGINS): the core alone.
    pytest.skip("the hardware plugins are disabled", allow_module_level=True)

HW_RULES = [n for n in registry.names("mesh_rules") if n != "cpu"]


def _chosen(backend, *args):
    return select_kernel(*args, backend=backend)[0]


def _reason(backend, name, *args):
    return next(c.reason for c in kernel_choices(*args, backend=backend) if c.name == name)


def test_hardware_plugins_depend_on_the_core_alone():
    import subprocess
    import sys

    import importlib_metadata

    for dist in ("axplug-gpu", "axplug-tpu", "axplug-trainium"):
        requires = importlib_metadata.requires(dist) or []
        assert not [r for r in requires if r.startswith("axplug-attention")], (dist, requires)
    script = "import sys, axplug_gpu, axplug_tpu, axplug_trainium\n"
    script += "print(sorted(m for m in sys.modules if m.startswith('axplug_attention')))"
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True
    )
    assert proc.stdout.strip() == "[]", proc.stdout


def test_every_plugin_registers_kernels_and_rules():
    kernels = set(registry.names("kernels"))
    assert {"cudnn_flash", "pallas_gpu_flash", "splash", "nki_flash"} <= kernels
    rules = set(registry.names("mesh_rules"))
    assert {"gpu-h100-8", "gpu-h100-8xn", "tpu-v5e-slice", "trn2-16"} <= rules


@pytest.mark.parametrize(
    "specs, names",
    [
        (axplug_gpu.SPECS, {"a100", "h100", "h200", "b200"}),
        (axplug_tpu.SPECS, {"v4", "v5e", "v5p", "v6e"}),
        (axplug_trainium.SPECS, {"trn1", "trn2"}),
    ],
)
def test_device_specs_are_complete(specs, names):
    assert set(specs) == names
    for spec in specs.values():
        assert isinstance(spec, DeviceSpec)
        assert 1e14 <= spec.peak_bf16_flops <= 1e16
        assert 8 * 2**30 <= spec.hbm_bytes <= 256 * 2**30
        assert spec.chips_per_host in (4, 8, 16)
        assert spec.source and spec.interconnect


@pytest.mark.parametrize("name", HW_RULES)
def test_every_rule_has_a_spec_and_registered_modifiers(name):
    assert isinstance(device_spec_of(name), DeviceSpec)
    rule = registry.load("mesh_rules", name)().instantiate()
    for spec in rule.config.modifiers:
        make_modifier(spec)  # raises if not a registered modifier with those fields
    from axplug.presets import preset_config

    cfg = rule.modifier()(preset_config("gpt-tiny", overrides=["output_dir='x'"]))
    assert cfg.model.compute_dtype == "bfloat16"
    assert tuple(cfg.mesh.mesh_shape)[1] != 1  # fsdp


@pytest.mark.parametrize(
    "selector, rule",
    [
        ("gpu-h100-8", "gpu-h100-8"),
        ("gpu-nvidia-h100-80gb-hbm3-8", "gpu-h100-8"),  # what detect_selector() gives
        ("gpu-h100-8x32", "gpu-h100-8xn"),
        ("gpu-h200-8", "gpu-h200-8"),
        ("gpu-nvidia-h200-1", "gpu-h200-8"),  # a one-GPU host
        ("gpu-nvidia-b200-8x4", "gpu-b200-8xn"),
        ("gpu-a100-sxm4-80gb-8", "gpu-a100-8"),
        ("tpu-v5e-256", "tpu-v5e-slice"),
        ("tpu-v5e-256x4", "tpu-v5e-256xn"),
        ("tpu-v5p-512", "tpu-v5p-slice"),
        ("tpu-v5p-1024", "tpu-v5p-slice"),
        ("tpu-v5p-512x2", "tpu-v5p-512xn"),
        ("tpu-tpu-v5-lite-8", "tpu-v5e-detected"),
        ("tpu-tpu-v5-8", "tpu-v5p-detected"),
        ("tpu-v4-32", "tpu-v4-slice"),
        ("tpu-v6e-256", "tpu-v6e-slice"),
        ("trn2-16", "trn2-16"),
        ("trn1-16x4", "trn1-16xn"),
        ("cpu-8", "cpu"),
    ],
)
def test_selectors_pick_the_rule(selector, rule):
    assert select_mesh_rule(selector)[0] == rule


def test_multi_host_rule_shards_fsdp_in_host_and_data_across():
    _, rule = select_mesh_rule("gpu-h100-8x32")
    assert rule.config.modifiers[0] == "mesh:fsdp=8,data=-1"
    _, rule = select_mesh_rule("tpu-v5e-256x4")
    assert rule.config.modifiers[0] == "mesh:fsdp=256,data=-1"


def test_availability_says_why_a_kernel_cannot_run_here():
    for name in ("cudnn_flash", "pallas_gpu_flash", "splash", "nki_flash"):
        kernel = registry.load("kernels", name)()
        assert kernel.availability("cpu")  # a reason on this CPU machine
    assert axplug_gpu.CudnnFlashKernel().availability("gpu") is None
    assert axplug_tpu.SplashAttentionKernel().availability("tpu") is None
    assert "jax-neuronx" in axplug_trainium.NkiFlashKernel().availability("neuron")


# --- kernel gating through the real dispatch -------------------------------------------------


def test_cpu_picks_the_portable_kernel_and_says_why_not_the_others():
    args = abstract_call()
    assert _chosen("cpu", *args) == "blockwise"  # 2048 keys: the memory-efficient XLA kernel
    assert _chosen("cpu", *abstract_call(seq=512)) == "xla"
    assert "CUDA GPU backend" in _reason("cpu", "cudnn_flash", *args)
    assert "TPU backend" in _reason("cpu", "splash", *args)
    assert "jax-neuronx" in _reason("cpu", "nki_flash", *args)


@pytest.mark.parametrize(
    "call, kernel",
    [
        (dict(), "cudnn_flash"),
        (dict(kv_heads=2), "cudnn_flash"),  # GQA
        (dict(sliding_window=256), "cudnn_flash"),
        (dict(dtype="float32"), "pallas_gpu_flash"),  # cuDNN flash is 16-bit only
        (dict(segments=True), "pallas_gpu_flash"),  # packed sequences
        (dict(segments=True, kv_heads=2), "blockwise"),  # neither: Pallas needs MHA
        (dict(dtype="float32", seq=100), "xla"),  # Pallas block 128
        (dict(q_seq=1), "blockwise"),  # decoding, 2048 cached keys
        (dict(q_seq=1, seq=512), "xla"),  # short: the plain XLA kernel
        (dict(head_dim=256), "pallas_gpu_flash"),  # cuDNN flash head_dim <= 128
        (dict(dtype="float32", head_dim=96), "blockwise"),
    ],
)
def test_gpu_selection(call, kernel):
    assert _chosen("gpu", *abstract_call(**call)) == kernel


def test_gpu_reasons_name_the_limit():
    assert "float32" in _reason("gpu", "cudnn_flash", *abstract_call("float32"))
    assert "segment ids" in _reason("gpu", "cudnn_flash", *abstract_call(segments=True))
    assert "grouped kv heads" in _reason("gpu", "pallas_gpu_flash", *abstract_call(kv_heads=2))
    assert "decoding" in _reason("gpu", "cudnn_flash", *abstract_call(q_seq=1))


@pytest.mark.parametrize(
    "call, kernel",
    [
        (dict(), "splash"),
        (dict(kv_heads=1), "splash"),  # MQA
        (dict(segments=True, sliding_window=512), "splash"),
        (dict(causal=False), "splash"),
        (dict(dtype="float32"), "splash"),
        (dict(head_dim=64), "blockwise"),
        (dict(seq=1000), "xla"),
        (dict(q_seq=1), "blockwise"),
        (dict(dtype="float16"), "blockwise"),
    ],
)
def test_tpu_selection(call, kernel):
    assert _chosen("tpu", *abstract_call(**call)) == kernel


# --- numerics: the Pallas kernels' wrappers in the Pallas interpreter on CPU -----------------


def _qkv(heads, kv_heads, seq=128, d=128):
    ks = jax.random.split(jax.random.PRNGKey(0), 3)
    q = jax.random.normal(ks[0], (1, seq, heads, d), jnp.float32)
    k = jax.random.normal(ks[1], (1, seq, kv_heads, d), jnp.float32)
    v = jax.random.normal(ks[2], (1, seq, kv_heads, d), jnp.float32)
    pos = jnp.arange(seq)[None]
    seg = (pos >= 50).astype(jnp.int32)
    return q, k, v, pos, seg


def test_pallas_gpu_wrapper_matches_reference_in_interpreter():
    q, k, v, pos, seg = _qkv(2, 2)
    kernel = axplug_gpu.PallasGpuFlashKernel()
    kernel.interpret = True
    for mask in (AttentionMask(pos, pos), AttentionMask(pos, pos, seg, seg)):
        want = ReferenceKernel()(q, k, v, mask, scale=0.1)
        assert jnp.allclose(kernel(q, k, v, mask, scale=0.1), want, atol=2e-5)


def test_splash_wrapper_matches_reference_in_interpreter():
    q, k, v, pos, seg = _qkv(4, 2)  # GQA
    kernel = axplug_tpu.SplashAttentionKernel()
    kernel.interpret = True
    for mask in (
        AttentionMask(pos, pos),
        AttentionMask(pos, pos, seg, seg),
        AttentionMask(pos, pos, sliding_window=16),
        AttentionMask(pos, pos, causal=False),
    ):
        want = ReferenceKernel()(q, k, v, mask, scale=0.1)
        assert jnp.allclose(kernel(q, k, v, mask, scale=0.1), want, atol=2e-5)


# --- numerics on real hardware (skipped elsewhere) -------------------------------------------


def _on_hardware(q, k, v, mask, name):
    kernel = registry.load("kernels", name)()
    assert kernel.is_supported(q, k, v, mask, jax.default_backend()) is True
    out = jax.jit(lambda q, k, v: kernel(q, k, v, mask, scale=0.125))(q, k, v)
    want = ReferenceKernel()(q, k, v, mask, scale=0.125)
    # bf16 inputs: compare in f32 with a bf16-sized tolerance.
    assert jnp.allclose(out.astype(jnp.float32), want.astype(jnp.float32), atol=2e-2)
    grad = jax.grad(lambda q: kernel(q, k, v, mask, scale=0.125).astype(jnp.float32).sum())(q)
    ref = jax.grad(lambda q: ReferenceKernel()(q, k, v, mask, scale=0.125).sum())(q)
    assert jnp.allclose(grad.astype(jnp.float32), ref.astype(jnp.float32), atol=5e-2)


@pytest.mark.parametrize(
    "backend, names",
    [
        pytest.param("gpu", ["cudnn_flash", "pallas_gpu_flash"], marks=pytest.mark.gpu),
        pytest.param("tpu", ["splash"], marks=pytest.mark.tpu),
        pytest.param("neuron", ["nki_flash"], marks=pytest.mark.neuron),
    ],
)
def test_kernels_on_real_hardware(backend, names):
    if jax.default_backend() != backend:
        pytest.skip(f"needs a {backend} device")
    q, k, v, pos, _ = _qkv(8, 8, seq=1024)
    q, k, v = (x.astype(jnp.bfloat16) for x in (q, k, v))
    for name in names:
        _on_hardware(q, k, v, AttentionMask(pos, pos), name)
    # ALiBi slopes: only kernels declaring the bias take it; they must equal the reference.
    slopes = jnp.asarray([2.0 ** (-i) for i in range(1, 9)], jnp.float32)
    biased = AttentionMask(pos, pos, linear_bias_slopes=slopes)
    for name in names:
        if getattr(registry.load("kernels", name), "supports_linear_bias", False):
            _on_hardware(q, k, v, biased, name)


def test_list_check_shows_hardware_kernels_unavailable_with_reasons(capsys):
    import json

    from axplug.cli import main

    assert main(["list", "--kind", "kernels", "--check", "--json"]) == 0
    rows = {r["name"]: r for r in json.loads(capsys.readouterr().out)}
    assert rows["xla"]["status"] == "ok" and rows["reference"]["status"] == "ok"
    for name in ("cudnn_flash", "pallas_gpu_flash", "splash", "nki_flash"):
        if name in rows and rows[name]["status"] != "disabled":
            assert rows[name]["status"] == "unavailable", rows[name]
            assert rows[name]["reason"], rows[name]


# --- the conformance kit on every hardware mesh rule ------------------------------------------

from axplug_testing import MeshRuleConformance  # noqa: E402

# rule -> selectors it must win among the installed rules (`detect_selector()` forms included).
RULE_SELECTORS = {
    "gpu-a100-8": ["gpu-a100-8", "gpu-nvidia-a100-sxm4-80gb-8"],
    "gpu-a100-8xn": ["gpu-a100-8x4"],
    "gpu-h100-8": ["gpu-h100-8", "gpu-nvidia-h100-80gb-hbm3-8"],
    "gpu-h100-8xn": ["gpu-h100-8x32"],
    "gpu-h200-8": ["gpu-h200-8", "gpu-nvidia-h200-8"],
    "gpu-h200-8xn": ["gpu-h200-8x2"],
    "gpu-b200-8": ["gpu-b200-8"],
    "gpu-b200-8xn": ["gpu-nvidia-b200-8x4"],
    "tpu-v4-slice": ["tpu-v4-32", "tpu-tpu-v4-8"],
    "tpu-v5e-256xn": ["tpu-v5e-256x4"],
    "tpu-v5e-slice": ["tpu-v5e-256", "tpu-v5e-8"],
    "tpu-v5e-detected": ["tpu-tpu-v5-lite-8"],
    "tpu-v5p-512xn": ["tpu-v5p-512x2"],
    "tpu-v5p-slice": ["tpu-v5p-512", "tpu-v5p-1024"],
    "tpu-v5p-detected": ["tpu-tpu-v5-8"],
    "tpu-v6e-256xn": ["tpu-v6e-256x2"],
    "tpu-v6e-slice": ["tpu-v6e-256"],
    "tpu-v6e-detected": ["tpu-tpu-v6-lite-8"],
    "trn1-16": ["trn1-16"],
    "trn1-16xn": ["trn1-16x4"],
    "trn2-16": ["trn2-16"],
    "trn2-16xn": ["trn2-16x2"],
}


def test_every_hardware_rule_is_run_through_the_kit():
    assert sorted(RULE_SELECTORS) == HW_RULES


class TestHardwareMeshRuleConformance(MeshRuleConformance):
    capabilities = ("device_spec", "registered")

    @pytest.fixture(params=sorted(RULE_SELECTORS))
    def rule_name(self, request):
        return request.param

    @pytest.fixture
    def rule(self, rule_name):
        return registry.load("mesh_rules", rule_name)

    @pytest.fixture
    def selectors(self, rule_name):
        return RULE_SELECTORS[rule_name]

    @pytest.fixture
    def presets(self):
        return ["gpt-tiny", "llama-tiny"]  # the LLaMA layout too (axplug-attention)


# --- device utilisation for the watchdog (NVML, the TPU runtime) ------------------------------


def test_installed_hardware_plugins_answer_the_utilization_hook_on_cpu():
    from axplug.trainer.hooks import HookRunner

    runner = HookRunner(registry.plugin_manager())
    names = [impl.plugin_name for impl in runner._pm.hook.device_utilization.get_hookimpls()]
    assert any("axplug-gpu" in n for n in names) and any("axplug-tpu" in n for n in names)
    assert runner.first("device_utilization", devices=jax.devices()) is None  # CPUs: no reader
    assert runner.failures == []


def test_mesh_rules_choose_layouts_never_numerics_and_the_v5e_offload_is_overridable():
    """One command trains the same arithmetic on every chip: no installed rule quantizes
    (int8 on v5e is the explicit `quantize:int8`); v5e's offload remat is a rule's memory
    choice, undone by a later modifier."""
    from axplug_quantize import QuantizedLinear

    from axplug.config import find_configs
    from axplug.layers import RepeatedTransformer
    from axplug.presets import preset_config

    rules = [c for c in registry.discover("mesh_rules") if c.loadable]
    assert {c.distribution for c in rules} >= {"axplug-tpu", "axplug-gpu"}
    for c in rules:
        rule = registry.load("mesh_rules", c.qualified_name)().instantiate()
        cfg = rule.modifier()(preset_config("llama-tiny"))
        assert not find_configs(cfg, QuantizedLinear), c.qualified_name
    _, rule = select_mesh_rule("tpu-v5e-256x4")
    cfg = rule.modifier()(preset_config("llama-tiny"))
    assert {s.remat_policy for _, s in find_configs(cfg, RepeatedTransformer)} == {"offload"}
    cfg = make_modifier("scan_layers:remat_policy=full")(cfg)
    assert {s.remat_policy for _, s in find_configs(cfg, RepeatedTransformer)} == {"full"}
