"""`axplug new-plugin`: the generated package lints clean, installs, is discovered, and its
tests (the conformance kit) pass."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from axplug.cli import new_plugin_cmd
from axplug.cli.new_plugin_cmd import KINDS, generate, names_for

tomllib = pytest.importorskip("tomllib")  # Python 3.11+

RUFF = shutil.which("ruff") or str(Path(sys.executable).parent / "ruff")


def fake_install(root: Path, site: Path) -> dict:
    """What `pip install -e` does, minus pip: a dist-info from pyproject.toml, and a path entry."""
    project = tomllib.loads((root / "pyproject.toml").read_text())["project"]
    info = site / f"{project['name'].replace('-', '_')}-{project['version']}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: {project['name']}\nVersion: {project['version']}\n\n"
    )
    groups = project["entry-points"]
    (info / "entry_points.txt").write_text(
        "".join(
            f"[{group}]\n" + "".join(f"{k} = {v}\n" for k, v in eps.items()) + "\n"
            for group, eps in groups.items()
        )
    )
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(site), str(root), env.get("PYTHONPATH")]))
    env.pop("AXPLUG_LOAD_PLUGINS", None)
    env.pop("AXPLUG_DISABLE_PLUGINS", None)
    return env


def run(cmd, cwd, env=None, timeout=300):
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{cmd} failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    return proc.stdout


def test_names():
    assert names_for("axplug-sq_relu") == {
        "dist": "axplug-sq-relu",
        "module": "axplug_sq_relu",
        "name": "sq_relu",
        "cls": "SqRelu",
    }
    assert names_for("MyAttn")["module"] == "myattn"
    with pytest.raises(ValueError, match="use letters, digits and dashes"):
        names_for("9lives")
    with pytest.raises(ValueError, match="cannot be a package name"):
        names_for("axplug")


def cli_main(argv):
    """`axplug` with just this command (main.COMMANDS registers it for real)."""
    import argparse

    parser = argparse.ArgumentParser(prog="axplug")
    new_plugin_cmd.add_parser(parser.add_subparsers())
    args = parser.parse_args(argv)
    return args.run(args)


def test_cli_writes_and_refuses_to_overwrite(tmp_path, capsys):
    assert cli_main(["new-plugin", "axplug-x", "--kind", "modifier", "--dir", str(tmp_path)]) == 0
    root = tmp_path / "axplug-x"
    assert (root / "axplug_x" / "modifier.py").exists()
    assert "created modifier plugin" in capsys.readouterr().out
    assert cli_main(["new-plugin", "axplug-x", "--dir", str(tmp_path)]) == 2
    assert "--force" in capsys.readouterr().err


@pytest.mark.parametrize("kind", KINDS)
def test_generated_package_is_complete_and_lints_clean(tmp_path, kind):
    root = generate(f"axplug-demo-{kind}", kind, tmp_path)[0].parent
    project = tomllib.loads((root / "pyproject.toml").read_text())["project"]
    assert project["entry-points"]["axplug.plugin_api"] == {"1": root.name.replace("-", "_")}
    assert any(dep.startswith("axplug>=") for dep in project["dependencies"])
    assert (root / "README.md").read_text().startswith(f"# {root.name}")
    assert list((root / "tests").glob("test_*.py"))
    run([RUFF, "check", "--no-cache", "."], cwd=root)
    run([RUFF, "format", "--check", "--no-cache", "."], cwd=root)


def _installed_and_tested(tmp_path, kind):
    root = generate(f"axplug-demo-{kind}", kind, tmp_path / "src")[0].parent
    env = fake_install(root, tmp_path / "site")
    listed = run([sys.executable, "-m", "axplug.cli", "list", "--json", "--check"], tmp_path, env)
    import json

    mine = [c for c in json.loads(listed) if c["distribution"] == root.name]
    assert [c["status"] for c in mine] == ["ok"], mine
    out = run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"], root, env)
    assert " passed" in out and "failed" not in out, out


def test_generated_layer_plugin_passes_its_conformance_tests(tmp_path):
    _installed_and_tested(tmp_path, "layer")


@pytest.mark.slow
@pytest.mark.parametrize("kind", [k for k in KINDS if k != "layer"])
def test_generated_plugin_passes_its_tests(tmp_path, kind):
    _installed_and_tested(tmp_path, kind)


@pytest.mark.slow
def test_pip_install_editable_in_a_fresh_virtualenv(tmp_path):
    """The real story: `pip install -e` into a virtualenv layered over this environment."""
    import json
    import site
    import sysconfig
    import venv

    root = generate("axplug-demo-pip", "layer", tmp_path / "src")[0].parent
    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=False)
    python = env_dir / "bin" / "python"
    purelib = Path(
        run(
            [str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"], tmp_path
        ).strip()
    )
    # This environment's packages (jax, axplug editable, pip) stay visible underneath.
    parents = [*site.getsitepackages(), sysconfig.get_path("purelib")]
    (purelib / "_parent_env.pth").write_text(
        "".join(f"import site; site.addsitedir({p!r})\n" for p in dict.fromkeys(parents))
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("AXPLUG_")}
    env.pop("PYTHONPATH", None)
    run(
        # Build isolation fetches the generated pyproject's setuptools>=69 from the index.
        [str(python), "-m", "pip", "install", "-q", "--no-deps", "-e", str(root)],
        tmp_path, env,
    )  # fmt: skip
    listed = json.loads(run([str(python), "-m", "axplug.cli", "list", "--json"], tmp_path, env))
    assert any(c["distribution"] == "axplug-demo-pip" for c in listed), listed
    out = run([str(python), "-m", "pytest", "-q", "-p", "no:cacheprovider"], root, env)
    assert " passed" in out and "failed" not in out, out
