"""Topology-aware meshes and selectors: device layout over slices and hosts, `detect_selector`
on multi-host machines, and the hardware rule each detected selector picks. Real accelerators
are simulated with plain device objects; the arrangement is a pure function over them."""

from __future__ import annotations

import dataclasses
import itertools
import logging

import jax
import numpy as np
import pytest
from jax.experimental import mesh_utils

from axplug import registry
from axplug.config import ConfigError
from axplug.mesh import MESH_AXES, MeshBuilder, _device_array
from axplug.mesh_rules import MeshRule, detect_selector, select_mesh_rule
from axplug.presets import preset_config

H100 = "NVIDIA H100 80GB HBM3"

# The hardware rules come from the axplug-gpu, -tpu and -trainium plugins.
needs_hw_rules = pytest.mark.skipif(
    not {"gpu-h100-8xn", "tpu-v5e-256xn", "trn2-16xn"} <= set(registry.names("mesh_rules")),
    reason="the hardware plugins are not installed or are disabled",
)


@dataclasses.dataclass(frozen=True)
class FakeDevice:
    """What mesh_utils and detect_selector read of a jax device."""

    id: int
    platform: str
    device_kind: str
    process_index: int = 0
    slice_index: int = 0
    coords: tuple[int, int, int] = (0, 0, 0)
    core_on_chip: int = 0


def gpus(hosts: int, per_host: int = 8, kind: str = H100, interleave: bool = False):
    """`hosts` processes of `per_host` GPUs; `interleave` lists them round-robin by process."""
    devices = [
        FakeDevice(i, "gpu", kind, process_index=i // per_host) for i in range(hosts * per_host)
    ]
    if interleave:
        devices = [FakeDevice(i, "gpu", kind, process_index=i % hosts) for i in range(len(devices))]
    return devices


def tpus(slices: int, dims=(2, 2, 2), kind: str = "TPU v4", chips_per_host: int = 4):
    """`slices` TPU slices of `dims` chips each (ids x fastest, one core per chip)."""
    devices = []
    per_slice = int(np.prod(dims))
    for s in range(slices):
        for z, y, x in itertools.product(*(range(d) for d in reversed(dims))):
            i = len(devices)
            devices.append(
                FakeDevice(
                    i,
                    "tpu",
                    kind,
                    process_index=i // chips_per_host,
                    slice_index=s,
                    coords=(x, y, z),
                )
            )
    assert len(devices) == slices * per_slice
    return devices


def neuron(hosts: int, per_host: int, kind: str):
    """`hosts` Neuron instances of `per_host` NeuronCores of device kind `kind`."""
    return [
        FakeDevice(i, "neuron", kind, process_index=i // per_host) for i in range(hosts * per_host)
    ]


def shape(data=1, fsdp=1, expert=1, seq=1, model=1):
    """A mesh shape over MESH_AXES."""
    return (data, fsdp, expert, seq, model)


def attr(array: np.ndarray, name: str) -> np.ndarray:
    """`name` of every device in `array`, same shape."""
    return np.vectorize(lambda d: getattr(d, name))(array)


# --- detect_selector -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "devices, selector",
    [
        (gpus(1), "gpu-nvidia-h100-80gb-hbm3-8"),
        (gpus(32), "gpu-nvidia-h100-80gb-hbm3-8x32"),
        (gpus(4, interleave=True), "gpu-nvidia-h100-80gb-hbm3-8x4"),
        # One slice over two hosts: a TPU "host" in a selector is a slice, not a process.
        (tpus(1, dims=(4, 4, 1), kind="TPU v5 lite", chips_per_host=8), "tpu-tpu-v5-lite-16"),
        (tpus(4, dims=(4, 4, 1), kind="TPU v5 lite"), "tpu-tpu-v5-lite-16x4"),
        (tpus(2, kind="TPU v4"), "tpu-tpu-v4-8x2"),
        (neuron(1, 32, "NC_v2"), "neuron-nc-v2-32"),
        (neuron(4, 64, "NC_v3d"), "neuron-nc-v3d-64x4"),
        # CPU keeps the total, however many processes hold it.
        ([FakeDevice(i, "cpu", "cpu", process_index=i // 4) for i in range(8)], "cpu-8"),
    ],
)
def test_detect_selector_counts_devices_per_host_and_hosts(devices, selector):
    assert detect_selector(devices) == selector


def test_detect_selector_of_this_machine_is_unchanged():
    assert detect_selector() == detect_selector(jax.devices()) == "cpu-8"


def test_tpu_slices_of_256_give_the_multi_slice_selector():
    devices = [
        FakeDevice(i, "tpu", "TPU v5 lite", process_index=i // 8, slice_index=i // 256)
        for i in range(1024)
    ]
    assert detect_selector(devices) == "tpu-tpu-v5-lite-256x4"


# --- selectors pick the intended rule -----------------------------------------------------------


@needs_hw_rules
@pytest.mark.parametrize(
    "selector, rule, mesh",
    [
        ("gpu-nvidia-h100-80gb-hbm3-8", "gpu-h100-8", "mesh:fsdp=-1"),
        ("gpu-nvidia-h200-1", "gpu-h200-8", "mesh:fsdp=-1"),  # one GPU: the host rule
        ("gpu-nvidia-h100-80gb-hbm3-4", "gpu-h100-8", "mesh:fsdp=-1"),
        ("gpu-nvidia-h100-80gb-hbm3-8x32", "gpu-h100-8xn", "mesh:fsdp=8,data=-1"),
        ("gpu-nvidia-h200-8x2", "gpu-h200-8xn", "mesh:fsdp=8,data=-1"),
        ("tpu-tpu-v5-lite-256", "tpu-v5e-detected", "mesh:fsdp=-1"),
        ("tpu-tpu-v5-lite-256x4", "tpu-v5e-256xn", "mesh:fsdp=256,data=-1"),
        ("tpu-tpu-v5e-256x2", "tpu-v5e-256xn", "mesh:fsdp=256,data=-1"),
        ("tpu-tpu-v6-lite-256x2", "tpu-v6e-256xn", "mesh:fsdp=256,data=-1"),
        ("tpu-tpu-v5-512x2", "tpu-v5p-512xn", "mesh:fsdp=512,data=-1"),
        ("tpu-tpu-v5p-1024x2", "tpu-v5p-512xn", "mesh:fsdp=512,data=-1"),
        ("tpu-tpu-v5p-512", "tpu-v5p-detected", "mesh:fsdp=-1"),
        ("tpu-v5e-256x4", "tpu-v5e-256xn", "mesh:fsdp=256,data=-1"),
        ("tpu-tpu-v4-16", "tpu-v4-slice", "mesh:fsdp=-1"),
        ("neuron-nc-v2-32", "trn1-16", "mesh:fsdp=-1"),
        ("neuron-nc-v2-32x4", "trn1-16xn", "mesh:fsdp=16,data=-1"),
        ("neuron-nc-v3d-64", "trn2-16", "mesh:fsdp=-1"),
        ("neuron-nc-v3d-64x8", "trn2-16xn", "mesh:fsdp=16,data=-1"),
        ("neuron-nc-v3-128x2", "trn2-16xn", "mesh:fsdp=16,data=-1"),
        ("neuron-trn2-16", "trn2-16", "mesh:fsdp=-1"),
        ("neuron-trainium-trn1-16x2", "trn1-16xn", "mesh:fsdp=16,data=-1"),
        ("trn2-16x4", "trn2-16xn", "mesh:fsdp=16,data=-1"),
    ],
)
def test_detected_selectors_pick_the_intended_rule(selector, rule, mesh):
    name, chosen = select_mesh_rule(selector)
    assert (name, chosen.config.modifiers[0]) == (rule, mesh)


@needs_hw_rules
@pytest.mark.parametrize(
    "selector",
    [
        "tpu-tpu-v4-16x2",  # no multi-slice v4 rule
        "tpu-tpu-v5-lite-64x4",  # only whole 256-chip v5e slices have one
        "tpu-v5e-64x4",
        "tpu-tpu-v5p-256x2",  # fsdp=512 would cross slices
        "neuron-nc-v2-24",  # inf2.48xlarge: NeuronCore-v2 too, not a Trainium instance
        "neuron-nc-v3d-8x2",  # 16 does not divide 8 devices per instance
    ],
)
def test_selectors_no_rule_fits_match_none_rather_than_spread_fsdp(selector):
    with pytest.raises(ConfigError, match="no installed mesh rule matches"):
        select_mesh_rule(selector)


@needs_hw_rules
def test_no_multi_host_selector_gets_a_single_host_rule():
    multi = [
        "gpu-nvidia-h100-80gb-hbm3-8x32",
        "tpu-tpu-v5-lite-256x4",
        "tpu-tpu-v6-lite-256x2",
        "tpu-tpu-v5-512x2",
        "tpu-v5p-1024x2",
        "neuron-nc-v3d-64x8",
        "neuron-nc-v2-32x2",
    ]
    for name in registry.names("mesh_rules"):
        rule = registry.load("mesh_rules", name)().instantiate()
        if "fsdp=-1" in rule.config.modifiers[0]:
            assert not [s for s in multi if rule.matches(s)], name


def test_re_patterns_match_whole_selectors_case_insensitively():
    rule = MeshRule.default_config().set(pattern=r"re:tpu-v5e-\d+").instantiate()
    assert rule.matches("tpu-v5e-256") and rule.matches("TPU-V5E-8")
    assert not rule.matches("tpu-v5e-256x4") and not rule.matches("xtpu-v5e-8")
    bad = MeshRule.default_config().set(pattern="re:tpu-(").instantiate()
    with pytest.raises(ConfigError, match=r"pattern 're:tpu-\(' is not a valid regular"):
        bad.matches("tpu-v5e-8")


# --- device layout -------------------------------------------------------------------------------


@pytest.mark.parametrize("mesh_shape", [shape(data=8), shape(2, 4), shape(1, 2, 1, 2, 2)])
def test_cpu_meshes_keep_the_device_order(mesh_shape):
    devices = jax.devices()
    mesh = MeshBuilder.default_config().set(mesh_shape=mesh_shape).instantiate().build()
    want = np.asarray(devices).reshape(mesh_shape)
    assert mesh.devices.tolist() == want.tolist()
    # mesh_utils itself lays CPU devices out in their given order.
    assert mesh_utils.create_device_mesh(mesh_shape, devices).tolist() == want.tolist()


def test_build_keeps_the_shape_errors():
    builder = MeshBuilder.default_config().set(mesh_shape=(3, 1, 1, 1, -1)).instantiate()
    with pytest.raises(
        ConfigError, match="8 devices are not divisible by the fixed axes' product 3"
    ):
        builder.build()


def test_hybrid_tpu_mesh_puts_data_across_slices_and_fsdp_inside():
    one, two = tpus(2)[:8], tpus(2)[8:]  # 2 slices of 2x2x2 chips
    devices = [d for pair in zip(two, one, strict=True) for d in pair]  # interleaved, slice 1 first
    array = _device_array(devices, shape(data=2, fsdp=8), MESH_AXES)
    slices = attr(array, "slice_index")
    assert slices.shape == (2, 8, 1, 1, 1)
    assert (slices[0] == 0).all() and (slices[1] == 1).all()
    # Inside a slice, the torus layout of that slice alone.
    assert array[:1].tolist() == mesh_utils.create_device_mesh(shape(fsdp=8), one).tolist()
    # Only as much of `data` as there are slices crosses them: rows 0-1 in slice 0, 2-3 in 1.
    slices = attr(_device_array(devices, shape(data=4, fsdp=4), MESH_AXES), "slice_index")
    assert slices[:, :, 0, 0, 0].tolist() == [[0] * 4, [0] * 4, [1] * 4, [1] * 4]


def test_within_a_slice_the_layout_follows_the_torus():
    devices = tpus(1)
    array = _device_array(devices, shape(data=2, fsdp=4), MESH_AXES)
    want = mesh_utils.create_device_mesh(shape(data=2, fsdp=4), devices)
    assert array.tolist() == want.tolist()
    # A 2x2x2 torus: each fsdp row is one z-plane of 4 chips, not 4 consecutive ids.
    assert [{d.coords[2] for d in row.flat} for row in array] == [{0}, {1}]


def test_gpu_hosts_are_grouped_by_process_whatever_the_device_order():
    devices = gpus(4, interleave=True)
    processes = attr(_device_array(devices, shape(data=4, fsdp=8), MESH_AXES), "process_index")
    assert [set(row.flat) for row in processes] == [{0}, {1}, {2}, {3}]
    plain = attr(np.asarray(devices).reshape(shape(data=4, fsdp=8)), "process_index")
    assert [set(row.flat) for row in plain] == [{0, 1, 2, 3}] * 4  # what a reshape would do


@needs_hw_rules
def test_neuron_instances_keep_fsdp_inside_an_instance():
    devices = neuron(2, 64, "NC_v3d")
    rule = select_mesh_rule(detect_selector(devices))[1]
    assert rule.config.modifiers[0] == "mesh:fsdp=16,data=-1"
    array = _device_array(devices, shape(data=8, fsdp=16), MESH_AXES)
    processes = attr(array, "process_index")[:, :, 0, 0, 0]
    assert all(len(set(row)) == 1 for row in processes)
    assert processes[:4].max() == 0 and processes[4:].min() == 1


def test_data_too_small_to_span_the_slices_warns_and_keeps_the_plain_order(caplog):
    devices = tpus(2)
    with caplog.at_level(logging.WARNING, logger="axplug.mesh"):
        array = _device_array(devices, shape(fsdp=16), MESH_AXES)
    assert [d.id for d in array.flat] == list(range(16))
    assert "not a multiple of the 2 slices" in caplog.text
    assert "data=-1" in caplog.text  # the fix


@pytest.mark.parametrize(
    "devices, mesh_shape, why",
    [
        (gpus(2)[:12], shape(data=2, fsdp=6), "no topology-aware layout"),  # uneven hosts
        (tpus(1)[:6], shape(fsdp=6), "no topology-aware layout"),  # a hole in the slice
    ],
)
def test_layouts_mesh_utils_cannot_make_fall_back_to_the_plain_order(
    devices, mesh_shape, why, caplog
):
    with caplog.at_level(logging.WARNING, logger="axplug.mesh"):
        array = _device_array(devices, mesh_shape, MESH_AXES)
    assert array.tolist() == np.asarray(devices).reshape(mesh_shape).tolist()
    assert why in caplog.text


@needs_hw_rules
@pytest.mark.parametrize(
    "devices, rule_name, group",
    [
        (gpus(4), "gpu-h100-8xn", "process_index"),
        (tpus(2, dims=(16, 16, 1), kind="TPU v5 lite"), "tpu-v5e-256xn", "slice_index"),
        (neuron(2, 32, "NC_v2"), "trn1-16xn", "process_index"),
    ],
)
def test_detected_rule_and_layout_keep_fsdp_inside_a_host(devices, rule_name, group):
    name, rule = select_mesh_rule(detect_selector(devices))
    assert name == rule_name
    cfg = rule.modifier()(preset_config("gpt-tiny", overrides=["output_dir='x'"]))
    mesh_shape = cfg.mesh.instantiate().resolved_shape(len(devices))
    groups = attr(_device_array(devices, mesh_shape, MESH_AXES), group)
    # Every data index holds devices of one host: fsdp (and the rest) never cross hosts.
    assert all(len(set(row)) == 1 for row in groups.reshape(mesh_shape[0], -1))


def test_detected_device_spec_is_the_selected_rules_chip():
    from axplug.mesh_rules import detected_device_spec

    pytest.importorskip("axplug_gpu")
    assert detected_device_spec(gpus(4)).peak_bf16_flops == 989e12  # H100 x 4 hosts
    assert detected_device_spec(gpus(1, kind="NVIDIA H200")).name.startswith("NVIDIA H200")
    assert detected_device_spec(jax.devices()) is None  # CPU: no device spec
