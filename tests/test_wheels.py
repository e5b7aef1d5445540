"""`make wheels` and the install story: a fresh virtualenv with only the core wheel has no MoE,
`pip install --no-index --find-links dist axplug-moe` adds it, and the `moe` modifier trains."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import venv
from pathlib import Path

import pytest
from axplug_testing import tiny_train_args

ROOT = Path(__file__).resolve().parents[1]
PLUGINS = sorted(p.parent.name for p in (ROOT / "plugins").glob("*/pyproject.toml"))

pytestmark = pytest.mark.slow


def run(cmd, *, cwd, env=None, timeout=900):
    proc = subprocess.run(
        [str(c) for c in cmd], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout
    )
    assert proc.returncode == 0, f"{cmd} failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    return proc.stdout


def pins(path: Path) -> Path:
    """This environment's versions as pip constraints: the fresh venv resolves the same, tested
    versions and takes them from pip's cache after the first run."""
    import importlib_metadata

    lines = sorted(
        {
            f"{d.metadata['Name']}=={d.version}"
            for d in importlib_metadata.distributions()
            if d.metadata["Name"] and not d.metadata["Name"].lower().startswith("axplug")
        }
    )
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.fixture(scope="module")
def dist(tmp_path_factory) -> Path:
    if shutil.which("make") is None:
        pytest.skip("needs `make`")
    out = tmp_path_factory.mktemp("dist")
    run(["make", "wheels", f"DIST={out}", f"PYTHON={sys.executable}"], cwd=ROOT)
    return out


def test_make_wheels_builds_the_core_and_every_plugin(dist):
    import zipfile

    import tomllib

    names = {p.name.split("-")[0] for p in dist.glob("*.whl")}
    expected = {"axplug"}
    for plugin in PLUGINS:
        project = tomllib.loads((ROOT / "plugins" / plugin / "pyproject.toml").read_text())
        expected.add(project["project"]["name"].replace("-", "_"))
    assert names == expected
    (core,) = dist.glob("axplug-*.whl")
    files = zipfile.ZipFile(core).namelist()
    assert "axplug/input/data/corpus.txt" in files  # package data: the demo corpus
    assert not any(f.startswith("axplug/testing/") for f in files)  # the kit is axplug-testing's
    assert not any(f.startswith(("axplug_", "tests/")) for f in files), "plugins in the core"


def test_fresh_virtualenv_core_then_moe_from_dist(dist, tmp_path):
    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=False, clear=True)
    python = env_dir / "bin" / "python"
    # A user's shell: no plugin switches, no fake devices from this suite's conftest.
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AXPLUG_", "PYTHON"))}
    env.pop("XLA_FLAGS", None)
    env["PATH"] = f"{env_dir / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    # This interpreter's pip drives the new environment (pip --python), so it needs no ensurepip.
    pip = [sys.executable, "-m", "pip", "--python", python, "--disable-pip-version-check"]
    (core,) = dist.glob("axplug-*.whl")
    run([*pip, "install", "-q", "-c", pins(tmp_path / "pins.txt"), core], cwd=tmp_path, env=env)

    def listed() -> list[dict]:
        return json.loads(
            run([python, "-m", "axplug.cli", "list", "--json"], cwd=tmp_path, env=env)
        )

    before = listed()
    assert {c["distribution"] for c in before} == {"axplug"}, "a fresh venv has only the core"
    assert not [c for c in before if "moe" in c["name"]], before

    run([*pip, "install", "-q", "--no-index", "--find-links", dist, "axplug-moe"], cwd=tmp_path,
        env=env)  # fmt: skip
    after = listed()
    moe = {(c["kind"], c["name"]) for c in after if c["distribution"] == "axplug-moe"}
    assert {("modifiers", "moe"), ("layers", "moe_feed_forward"), ("presets", "moe-tiny")} <= moe
    assert all(c["status"] == "ok" for c in after if c["distribution"] == "axplug-moe"), after

    out = tmp_path / "run"
    moe = ["moe:num_experts=4,top_k=2"]
    train = tiny_train_args(out, "log_every=1", modifiers=moe, max_steps=3)
    run([python, "-m", "axplug.cli", *train], cwd=tmp_path, env=env)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "loss" in r]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all("load_balance_loss" in r for r in rows), "the MoE aux losses reach the metrics"
    assert (
        "moe_feed_forward" in (out / "config.txt").read_text()
        or "MoEFeedForward" in (out / "config.txt").read_text()
    )
