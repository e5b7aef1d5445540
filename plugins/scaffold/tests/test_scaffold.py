"""`axplug new-plugin`: the generated package lints clean, installs, is discovered, and its
tests (the conformance kit) pass; the plugin docs' tutorial and reference, checked as written."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from axplug_scaffold.command import KINDS, generate, names_for
from axplug_testing import cli_main, tiny_train_args

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


@pytest.fixture
def install(plugin_site, monkeypatch, request):
    """`pip install -e ROOT` in this process: ROOT's dist-info in the fake site (which hides
    every other plugin), ROOT on sys.path; its modules are unimported afterwards."""

    def installed(root: Path) -> None:
        project = tomllib.loads((root / "pyproject.toml").read_text())["project"]
        groups = dict(project["entry-points"])
        (api,) = groups.pop("axplug.plugin_api")
        plugin_site.add(project["name"], groups, version=project["version"], api=api)
        monkeypatch.syspath_prepend(str(root))
        packages = {p.parent.name for p in root.glob("*/__init__.py")}
        packages |= {p.stem for p in root.glob("*.py")}
        request.addfinalizer(lambda: [sys.modules.pop(m) for m in list(sys.modules)
                                      if m.partition(".")[0] in packages])  # fmt: skip

    return installed


def listed(axplug_cli, distribution: str) -> dict[tuple[str, str], str]:
    """{(kind, name): status} of `distribution`'s components in `axplug list --json --check`."""
    import json

    result = axplug_cli("list", "--json", "--check")
    assert result.exit_code == 0, result.stderr
    return {(c["kind"], c["name"]): c["status"] for c in json.loads(result.stdout)
            if c["distribution"] == distribution}  # fmt: skip


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


def test_every_kind_of_the_cli_has_a_template():
    from axplug_scaffold.command import KIND_GROUPS, template_files

    from axplug.api.registry import KINDS as GROUPS

    assert set(KINDS) == set(KIND_GROUPS) >= {"layer", "kernel", "mesh-rule", "modifier"}
    for kind, (group, _) in KIND_GROUPS.items():
        assert group.split(".", 1)[1] in GROUPS, group
        assert all(template_files(kind).values()), kind  # shipped as package data


def test_mesh_rule_kind_registers_a_rule_with_a_device_spec(tmp_path):
    root = generate("axplug-l40s", "mesh-rule", tmp_path)[0].parent
    project = tomllib.loads((root / "pyproject.toml").read_text())["project"]
    assert project["entry-points"]["axplug.mesh_rules"] == {
        "l40s": "axplug_l40s.mesh_rule:l40s_rule"
    }
    source = (root / "axplug_l40s" / "mesh_rule.py").read_text()
    assert "@with_device_spec(CHIP)" in source and 'PATTERN = "gpu-*l40s*-8"' in source
    assert "MeshRuleConformance" in (root / "tests" / "test_mesh_rule.py").read_text()


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


def _installed_and_tested(tmp_path, kind, install, axplug_cli):
    root = generate(f"axplug-demo-{kind}", kind, tmp_path / "src")[0].parent
    install(root)
    assert list(listed(axplug_cli, root.name).values()) == ["ok"]
    # Its tests in an interpreter of their own, as its developer runs them.
    env = fake_install(root, tmp_path / "site")
    out = run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"], root, env)
    assert " passed" in out and "failed" not in out, out


FAST_KINDS = ("layer", "mesh-rule", "command")  # the rest train a model each: `make test-all`


@pytest.mark.parametrize("kind", FAST_KINDS)
def test_generated_plugin_passes_its_conformance_tests(tmp_path, kind, install, axplug_cli):
    _installed_and_tested(tmp_path, kind, install, axplug_cli)


@pytest.mark.slow
@pytest.mark.parametrize("kind", [k for k in KINDS if k not in FAST_KINDS])
def test_generated_plugin_passes_its_tests(tmp_path, kind, install, axplug_cli):
    _installed_and_tested(tmp_path, kind, install, axplug_cli)


@pytest.mark.slow  # the layer kind installs and passes above; this adds a chosen name
def test_layer_with_its_modifier_under_a_chosen_name_installs_and_passes(tmp_path, capsys):
    argv = ["new-plugin", "axplug-acts", "--component", "sq_relu", "--with-modifier"]
    assert cli_main([*argv, "--dir", str(tmp_path / "src")]) == 0
    assert "created layer + modifier plugin" in capsys.readouterr().out
    root = tmp_path / "src" / "axplug-acts"
    project = tomllib.loads((root / "pyproject.toml").read_text())["project"]
    assert project["entry-points"]["axplug.layers"] == {"sq_relu": "axplug_acts.layer:SqRelu"}
    assert project["entry-points"]["axplug.modifiers"] == {
        "sq_relu": "axplug_acts.modifier:SqReluModifier"
    }
    run([RUFF, "check", "--no-cache", "."], cwd=root)
    run([RUFF, "format", "--check", "--no-cache", "."], cwd=root)
    env = fake_install(root, tmp_path / "site")
    import json

    listed = run([sys.executable, "-m", "axplug.cli", "list", "--json", "--check"], tmp_path, env)
    mine = {(c["kind"], c["name"]): c["status"] for c in json.loads(listed)
            if c["distribution"] == "axplug-acts"}  # fmt: skip
    assert mine == {("layers", "sq_relu"): "ok", ("modifiers", "sq_relu"): "ok"}
    out = run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"], root, env)
    assert "passed" in out and "failed" not in out and "skipped" not in out, out


def test_with_modifier_and_component_are_checked(tmp_path, capsys):
    base = ["new-plugin", "axplug-x", "--dir", str(tmp_path)]
    assert cli_main([*base, "--kind", "kernel", "--with-modifier"]) == 2
    assert "--with-modifier goes with --kind layer" in capsys.readouterr().err
    assert cli_main([*base, "--component", "Bad-Name"]) == 2
    assert "--component 'Bad-Name': use lowercase letters" in capsys.readouterr().err


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


# -- docs/writing-a-plugin.md, followed as a new user would ------------------------------------

TUTORIAL = Path(__file__).resolve().parents[3] / "docs" / "writing-a-plugin.md"


def tutorial_files(until_heading: str | None = None) -> dict[str, str]:
    """The tutorial's file blocks (first line `# <path>`, or `# <path> (add to the end)`), in
    order, up to the heading `until_heading`; later blocks for a path append to it."""
    import re

    text = TUTORIAL.read_text()
    if until_heading is not None:
        text = text[: text.index(f"\n## {until_heading}")]
    files: dict[str, str] = {}
    for block in re.findall(r"^```(?:python|toml)\n(.*?)^```", text, flags=re.S | re.M):
        header, _, body = block.partition("\n")
        match = re.fullmatch(r"# (axplug-sqrelu/\S+)( \(add to the end\))?", header)
        if not match:
            continue
        path, append = match.groups()
        assert append is None or path in files, f"{path}: added to before it is written"
        files[path] = files.get(path, "") + body if append else body
    return files


def write_tutorial(files: dict[str, str], where: Path) -> Path:
    for rel, text in files.items():
        (where / rel).parent.mkdir(parents=True, exist_ok=True)
        (where / rel).write_text(text)
    return where / "axplug-sqrelu"


def test_tutorial_first_step_is_a_listed_layer(tmp_path, install, axplug_cli):
    files = tutorial_files(until_heading="3. Grow it")
    assert set(files) == {"axplug-sqrelu/axplug_sqrelu.py", "axplug-sqrelu/pyproject.toml"}
    code = files["axplug-sqrelu/axplug_sqrelu.py"].splitlines()
    body = [line for line in code if line.strip() and not line.lstrip().startswith(('"""', "#"))]
    assert len(body) <= 22, "the first layer stays about ten lines of code"
    install(write_tutorial(files, tmp_path / "src"))
    assert listed(axplug_cli, "axplug-sqrelu") == {("layers", "sqrelu_feed_forward"): "ok"}
    info = axplug_cli("info", "sqrelu_feed_forward")
    assert info.exit_code == 0 and "axplug-sqrelu" in info.stdout, info
    assert "hidden_dim" in info.stdout


def test_tutorial_plugin_passes_the_kit_and_trains_through_its_modifier(
    tmp_path, install, axplug_cli
):
    root = write_tutorial(tutorial_files(), tmp_path / "src")
    install(root)
    assert listed(axplug_cli, "axplug-sqrelu") == {
        ("layers", "sqrelu_feed_forward"): "ok",
        ("modifiers", "sqrelu"): "ok",
        ("modifiers", "scalenorm"): "ok",
    }
    # The tutorial's train command, shortened.
    printed = axplug_cli(*tiny_train_args(tmp_path / "run", modifiers=["sqrelu"]), "--print-config")
    assert printed.exit_code == 0 and "axplug_sqrelu:SqReluFeedForward" in printed.stdout, printed
    # Its tests in an interpreter of their own, as its developer runs them.
    env = fake_install(root, tmp_path / "site")
    out = run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"], root, env)
    assert "16 passed" in out and "skipped" not in out, out
