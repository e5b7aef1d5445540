"""Templates of the plugin kinds that act around a run: trainer hooks, a checkpoint storage,
a mesh rule, a command. `$placeholders` are filled in by `axplug new-plugin`."""

from __future__ import annotations

__all__ = [
    "COMMAND",
    "COMMAND_TEST",
    "HOOKS",
    "HOOKS_TEST",
    "MESH_RULE",
    "MESH_RULE_TEST",
    "STORAGE",
    "STORAGE_TEST",
]

HOOKS = '''\
"""Trainer hooks: records every step's loss (see axplug.hookspecs for all hooks)."""

from __future__ import annotations

from axplug import hookimpl

__all__ = ["$cls"]


class $cls:
    """Keeps the loss of every step in `losses`."""

    def __init__(self):
        self.losses: list[float] = []

    @hookimpl
    def on_step_end(self, trainer, step: int, metrics: dict) -> None:
        if "loss" in metrics:
            self.losses.append(metrics["loss"])


# The entry point names this instance: hooks entry points load an object to register.
plugin = $cls()
'''

HOOKS_TEST = '''\
"""The hooks see every step of a short run, and the core accepts their names."""

import jax
from axplug.presets import preset_config
from axplug.registry import plugin_manager

from $module import $cls


def test_hook_names_are_core_hooks():
    plugin_manager($cls())  # rejects hooks the core does not define


def test_records_losses(tmp_path):
    cfg = preset_config(
        "gpt-tiny",
        overrides=[
            f"output_dir={str(tmp_path)!r}",
            "max_steps=2",
            "checkpoint_every=2",
            "compilation_cache_dir=None",
            "summary_writers=[]",
            "model.decoder.dim=32",
            "model.decoder.transformer.layer.feed_forward.hidden_dim=64",
            "input.seq_len=32",
            "input.batch_size=4",
            "mesh.mesh_shape=(1, 1, 1, 1, 1)",
        ],
    )
    recorder = $cls()
    cfg.instantiate(devices=jax.devices()[:1], hooks=(recorder,)).run()
    assert len(recorder.losses) == 2
'''

STORAGE = '''\
"""A checkpoint storage backend for `$name://` URLs (here: kept on the local disk).

Replace the file operations with your store's client; the conformance kit checks the semantics
the checkpointer relies on (overwrite, listing names, recursive delete, partial writes).
"""

from __future__ import annotations

import os

from axplug.checkpoint.storage import LocalStorage

__all__ = ["$cls"]

SCHEME = "$name"


class $cls(LocalStorage):
    """`$name:///abs/path` is the local path `/abs/path`."""

    def _local(self, url: str) -> str:
        prefix = f"{SCHEME}://"
        if not url.startswith(prefix):
            raise ValueError(f"{url!r} is not a {prefix} URL")
        return os.path.abspath(url[len(prefix) :])
'''

STORAGE_TEST = '''\
"""The axplug conformance kit run on this storage backend, through a real checkpoint."""

import pytest
from axplug.testing import StorageConformance

from $module import $cls
from $module.storage import SCHEME


class Test$cls(StorageConformance):
    capabilities = ("checkpoint",)

    @pytest.fixture
    def storage(self):
        return $cls()

    @pytest.fixture
    def root_url(self, tmp_path):
        return f"{SCHEME}://{tmp_path / 'root'}"
'''

MESH_RULE = '''\
"""A mesh rule for 8-chip hosts of one accelerator: FSDP over the 8 chips, scanned layers with
dot-saving remat, bfloat16 compute.

`axplug train --mesh-rule auto` picks it where `detect_selector()` (`<platform>-<device
kind>-<devices per host>`, `...x<hosts>` on several hosts) matches PATTERN. To force it, or
to plan against CHIP without the hardware:

    axplug train --preset llama-tiny --mesh-rule $name --output-dir runs/x
    axplug aot --preset llama-tiny --mesh-rule $name
"""

from __future__ import annotations

from axplug.aot import DeviceSpec, with_device_spec
from axplug.mesh_rules import MeshRule

__all__ = ["$func", "CHIP", "PATTERN"]

# Replace with your chip's datasheet numbers: `axplug aot` uses them for memory and MFU.
CHIP = DeviceSpec(
    name="$selector",
    platform="gpu",
    peak_bf16_flops=362e12,  # dense bf16 FLOP/s per chip
    hbm_bytes=48 * 2**30,  # per chip
    chips_per_host=8,
    interconnect="PCIe",
    source="the vendor's datasheet",
)
PATTERN = "gpu-*$selector*-8"


@with_device_spec(CHIP)
def $func() -> MeshRule.Config:
    """One host of 8: FSDP over its chips."""
    return MeshRule.default_config().set(
        pattern=PATTERN,
        modifiers=["mesh:fsdp=8", "scan_layers:remat_policy=dots", "compute_dtype:dtype=bfloat16"],
        description=f"{CHIP.name}, one host of 8 (FSDP)",
    )
'''

MESH_RULE_TEST = '''\
"""The axplug conformance kit run on this mesh rule: selectors, modifiers on stock presets."""

import pytest
from axplug.testing import MeshRuleConformance

from $module import $func


class TestMeshRule(MeshRuleConformance):
    capabilities = ("device_spec", "registered")

    @pytest.fixture
    def rule(self):
        return $func

    @pytest.fixture
    def rule_name(self):
        return "$name"  # the entry-point name in pyproject.toml

    @pytest.fixture
    def selectors(self):
        return ["gpu-$selector-8", "gpu-nvidia-$selector-48gb-8"]
'''

# kind -> (entry-point group, entry value suffix, component module source, test source)
COMMAND = '''\
"""`axplug $name RUN_DIR`: a run's last logged metrics.

Replace with what your command does; keep `add_parser` and `run`.
"""

from __future__ import annotations

import argparse
from typing import Any

__all__ = ["add_parser", "run"]


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "$name",
        help="a run's last logged metrics",
        description="Print the last record of RUN_DIR/metrics.jsonl, one metric a line.",
    )
    parser.add_argument("run_dir", metavar="RUN_DIR", help="an `axplug train` output directory")
    parser.set_defaults(run=run)
    return parser


def run(args: argparse.Namespace) -> int:
    # Heavy imports belong here, not at module level: `axplug --help` lists this command from
    # its docstring without importing it, and only `axplug $name` imports this module.
    import json
    import pathlib
    import sys

    path = pathlib.Path(args.run_dir) / "metrics.jsonl"
    lines = path.read_text().splitlines() if path.is_file() else []
    if not lines:
        print(f"axplug $name: error: no metrics in {path}", file=sys.stderr)
        return 1
    for key, value in json.loads(lines[-1]).items():
        print(f"{key}: {value}")
    return 0
'''

COMMAND_TEST = '''\
"""The command is listed by `axplug --help` and runs through the `axplug` CLI."""

import json

from axplug.cli import main


def test_prints_the_last_record(tmp_path, capsys):
    records = [{"step": 1, "loss": 2.5}, {"step": 2, "loss": 2.0}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\\n" for r in records))
    assert main(["$name", str(tmp_path)]) == 0
    assert capsys.readouterr().out == "step: 2\\nloss: 2.0\\n"


def test_a_directory_without_metrics_is_an_error(tmp_path, capsys):
    assert main(["$name", str(tmp_path)]) == 1
    assert "no metrics in" in capsys.readouterr().err


def test_listed_by_help(capsys):
    assert main(["--help"]) == 0
    assert "$name" in capsys.readouterr().out
'''
