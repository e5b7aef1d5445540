"""Golden losses: a tiny model's per-step losses and final parameter checksum on each layout,
compared bit for bit with the committed tests/golden/LAYOUT.json. A change that moves numerics
fails here; when it is intended, regenerate with `make golden` and commit the files.

Files record the jax version, XLA flags (the test session's: `make golden` runs under them) and
the CPU's instruction sets they were made with; under others the values are compared to 1e-5
relative instead (XLA's CPU code generation differs between releases, optimization levels and
instruction sets)."""

import json
import os
import platform
from pathlib import Path

import jax
import numpy as np
import pytest
from axplug_testing import tiny_trainer_config, train_steps

GOLDEN = Path(__file__).parent / "golden"
STEPS = 4
# layout -> (preset, modifiers, devices): every parallelism the trainer composes.
LAYOUTS = {
    "one_device": ("gpt-tiny", (), 1),
    "fsdp": ("gpt-tiny", ("mesh:fsdp=8",), 8),
    "fsdp_tp": ("llama-tiny", ("mesh:fsdp=4,model=2",), 8),
    "moe_ep": ("gpt-tiny", ("moe:num_experts=4,top_k=2", "mesh:fsdp=2,expert=4"), 8),
    "pipeline": (
        "llama-tiny",
        ("scan_layers", "pipeline:stages=2,microbatches=4", "mesh:pipeline=2,fsdp=4"),
        8,
    ),
    "scanned": ("llama-tiny", ("scan_layers", "mesh:fsdp=8"), 8),
}


# Instruction sets that change XLA's CPU code (and so the low bits): the same jax and flags on
# an AVX-512 host moved losses by one ulp from an AVX2 host's.
_CODEGEN_FEATURES = {"avx", "avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_bf16",
                     "avx512_fp16", "avx_vnni", "amx_tile", "asimd", "sve"}  # fmt: skip


def _cpu_features() -> list[str]:
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((ln for ln in f if ln.startswith(("flags", "Features"))), "")
    except OSError:
        flags = ""
    return sorted(_CODEGEN_FEATURES & set(flags.split(":")[-1].split()))


def _compiler() -> dict:
    flags = os.environ.get("XLA_FLAGS", "").split()
    return {
        "jax": jax.__version__,
        "xla_flags": sorted(f for f in flags if "device_count" not in f),
        "cpu": [platform.machine(), *_cpu_features()],
    }


def _record(layout: str, tmp_path: Path) -> dict:
    preset, modifiers, devices = LAYOUTS[layout]
    cfg = tiny_trainer_config(tmp_path, preset=preset, modifiers=modifiers, max_steps=STEPS)
    trainer = cfg.instantiate(devices=jax.devices()[:devices])
    state, metrics = train_steps(trainer, STEPS)
    leaves = jax.tree_util.tree_leaves(jax.device_get(state["params"]))
    checksum = sum(float(np.sum(np.asarray(leaf, np.float64) ** 2)) for leaf in leaves)
    return {
        **_compiler(),
        "layout": {"preset": preset, "modifiers": list(modifiers), "devices": devices},
        "losses": [float(m["loss"]) for m in metrics],
        "param_sum_of_squares": checksum,
    }


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_losses_and_parameters_match_the_golden_file(layout, tmp_path):
    got = _record(layout, tmp_path)
    path = GOLDEN / f"{layout}.json"
    if os.environ.get("AXPLUG_UPDATE_GOLDEN"):
        GOLDEN.mkdir(exist_ok=True)
        path.write_text(json.dumps(got, indent=2) + "\n")
    want = json.loads(path.read_text())
    assert got["layout"] == want["layout"], f"{path} is of another layout: run `make golden`"
    assert np.isfinite(got["losses"]).all()
    if {k: want.get(k) for k in _compiler()} == _compiler():
        assert got["losses"] == want["losses"], f"losses moved from {path}"
        assert got["param_sum_of_squares"] == want["param_sum_of_squares"]
    else:
        np.testing.assert_allclose(got["losses"], want["losses"], rtol=1e-5)
        np.testing.assert_allclose(
            got["param_sum_of_squares"], want["param_sum_of_squares"], rtol=1e-5
        )
