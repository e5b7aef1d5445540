"""The import structure the architecture promises: no circles between the core's packages, a
floor that imports nothing of the core, and plugins that use only the public API."""

from __future__ import annotations

import ast
import importlib
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
CORE = ROOT / "core" / "axplug"
# The plugin API's faces: the public submodules of `axplug.api` (its `_*` rooms are the floor's).
FACES = sorted(f"axplug.api.{p.stem}" for p in (CORE / "api").glob("[!_]*.py"))


def _node(module: str) -> str:
    """The package a module belongs to in the import graph: `axplug.<first part>`, except a
    face of the plugin API, which is a node of its own above everything it re-exports."""
    parts = module.split(".")
    return ".".join(parts[:3]) if ".".join(parts[:3]) in FACES else ".".join(parts[:2])


def _module_name(path: pathlib.Path, base: pathlib.Path) -> str:
    parts = list(path.relative_to(base).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(path: pathlib.Path, module: str) -> list[tuple[str, list[str], int]]:
    """(imported module, names, line) of every import outside `if TYPE_CHECKING:`, at any
    depth (function-level imports count: a lazy import that climbs is still a climb)."""
    tree = ast.parse(path.read_text(), str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = []

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                continue  # type-only: never executed
            if isinstance(child, ast.Import):
                found.extend((alias.name, [], child.lineno) for alias in child.names)
            elif isinstance(child, ast.ImportFrom):
                target = child.module or ""
                if child.level:
                    base = package.split(".")[: len(package.split(".")) - child.level + 1]
                    target = ".".join(base + ([child.module] if child.module else []))
                found.append((target, [a.name for a in child.names], child.lineno))
            visit(child)

    visit(tree)
    return found


def _core_graph() -> dict[str, dict[str, list[str]]]:
    """package -> imported package -> where: packages are `axplug.<first part>`."""
    graph: dict[str, dict[str, list[str]]] = {}
    for path in sorted(CORE.rglob("*.py")):
        module = _module_name(path, CORE.parent)
        source = _node(module)
        graph.setdefault(source, {})
        for target, _, line in _imports(path, module):
            if target.split(".")[0] != "axplug":
                continue
            target = _node(target)
            if target != source:
                where = f"{path.relative_to(ROOT)}:{line}"
                graph[source].setdefault(target, []).append(where)
    return graph


def _cycle(graph: dict[str, dict[str, list[str]]]) -> list[str] | None:
    """One import cycle between packages, as a path, or None."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in graph.get(node, {}):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt) :] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_the_cores_packages_import_each_other_without_a_circle():
    graph = _core_graph()
    cycle = _cycle(graph)
    if cycle:
        edges = [
            f"{a} -> {b} at {', '.join(graph[a][b])}"
            for a, b in zip(cycle, cycle[1:], strict=False)
        ]
        pytest.fail("import circle between core packages:\n" + "\n".join(edges))


def test_the_cycle_check_finds_a_circle():
    graph = {"a": {"b": ["x:1"]}, "b": {"c": ["y:2"]}, "c": {"a": ["z:3"]}, "d": {}}
    assert _cycle(graph) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b": []}, "b": {}}) is None


def test_the_floor_imports_nothing_of_the_core():
    allowed = {"axplug.api", "axplug.hookspecs"}
    for path in sorted((CORE / "api").glob("_*.py")):
        module = _module_name(path, CORE.parent)
        for target, _, line in _imports(path, module):
            if target.startswith("axplug") and target != "axplug":  # the root: its version
                assert any(target == a or target.startswith(a + ".") for a in allowed), (
                    f"{path.relative_to(ROOT)}:{line} imports {target}: the floor depends on "
                    "jax and the standard library only"
                )


def _plugin_sources() -> list[tuple[pathlib.Path, pathlib.Path]]:
    """(file, its distribution dir) of every first-party plugin's package source."""
    out = []
    for project in sorted((ROOT / "plugins").glob("*/pyproject.toml")):
        dist = project.parent
        for path in sorted(dist.rglob("*.py")):
            rel = path.relative_to(dist).parts
            if "tests" in rel or "build" in rel or any(p.endswith(".egg-info") for p in rel):
                continue
            out.append((path, dist))
    return out


def _public_names(module: str) -> set[str]:
    return set(getattr(importlib.import_module(module), "__all__", ()))


def _plugin_api_problems(paths: list[pathlib.Path], also: tuple[str, ...] = ()) -> list[str]:
    """Imports in `paths` of the core beyond `axplug.api`, its faces and `also`, or of a
    name that the module imported from does not export."""
    allowed = ("axplug.api", *FACES, *also)
    public = {module: _public_names(module) for module in allowed}
    problems = []
    for path in paths:
        for target, names, line in _imports(path, "plugin"):
            if target.split(".")[0] != "axplug":
                continue
            where = f"{path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}:{line}"
            if target not in public:
                problems.append(f"{where}: imports {target}, not axplug.api or one of its faces")
                continue
            faces = {n for n in names if target == "axplug.api" and f"axplug.api.{n}" in FACES}
            hidden = [n for n in names if n != "*" and n not in public[target] | faces]
            if hidden:
                problems.append(f"{where}: {target} does not export {', '.join(hidden)}")
    return problems


def test_plugins_import_only_the_plugin_api():
    # The test kit drives the core's trainer and commands as the core's own tests do: it is
    # released with the core, pinned to its exact version (checked below), not a plugin.
    sources = [path for path, dist in _plugin_sources() if dist.name != "testing"]
    assert len(sources) > 20
    kits = [path for path in sources if path.stem == "testing"]  # a plugin's test kit
    problems = _plugin_api_problems([p for p in sources if p not in kits])
    problems += _plugin_api_problems(kits, also=("axplug_testing",))
    assert not problems, "\n".join(problems)


def test_the_test_kit_is_released_with_the_core_it_reaches_into():
    import tomllib

    import axplug

    project = tomllib.loads((ROOT / "plugins/testing/pyproject.toml").read_text())["project"]
    assert f"axplug=={axplug.__version__}" in project["dependencies"]
    assert project["version"] == axplug.__version__


def test_plugin_tests_import_only_the_plugin_api_and_the_testing_kit():
    tests = sorted((ROOT / "plugins").glob("*/tests/**/*.py"))
    assert len(tests) > 20
    problems = _plugin_api_problems(tests, also=("axplug_testing",))
    assert not problems, "\n".join(problems)


def test_the_layering_check_refuses_a_core_module_and_an_unexported_name(tmp_path):
    (tmp_path / "plugin.py").write_text(
        "from axplug.layers import Linear\nfrom axplug.api.layers import _private\n"
        "from axplug.api import layers, ParameterSpec\nfrom axplug.api.config import REQUIRED\n"
    )
    problems = _plugin_api_problems([tmp_path / "plugin.py"])
    assert len(problems) == 2, problems
    assert "imports axplug.layers, not axplug.api" in problems[0]
    assert "axplug.api.layers does not export _private" in problems[1]


def test_the_core_never_imports_a_face():
    graph = _core_graph()
    climbs = [(a, b) for a in graph for b in graph[a] if b in FACES and a not in FACES]
    assert not climbs, climbs


def test_every_face_lists_what_it_exports():
    assert len(FACES) >= 10
    for module in FACES:
        names = _public_names(module)
        assert names, f"{module} has no __all__"
        missing = [n for n in names if not hasattr(importlib.import_module(module), n)]
        assert not missing, f"{module}.__all__ names missing attributes: {missing}"


def test_every_public_name_has_one_door():
    """A name is exported (`__all__`) once by the plugin API: by the floor or by one face."""
    doors: dict[str, list[str]] = {}
    for module in ("axplug.api", *FACES):
        for name in _public_names(module):
            doors.setdefault(name, []).append(module)
    several = {name: where for name, where in doors.items() if len(where) > 1}
    assert not several, several


def test_the_core_never_names_a_plugin_package():
    packages = sorted({p.parent.name for p in (ROOT / "plugins").glob("*/axplug_*/__init__.py")})
    assert "axplug_attention" in packages and "axplug_moe" in packages
    offenders = [
        f"{path.relative_to(ROOT)}: {name}"
        for path in sorted(CORE.rglob("*.py"))
        for name in packages
        if name in path.read_text(encoding="utf-8")
    ]
    assert not offenders, "\n".join(offenders)


def test_the_core_never_names_a_plugin_distribution():
    """Not in code, messages, help or comments: an install hint points to the docs, and a
    missing component that an installed (disabled) distribution has is named by the registry."""
    names = [
        re.search(r'^name = "(.+)"', project.read_text(), re.M).group(1)
        for project in sorted((ROOT / "plugins").glob("*/pyproject.toml"))
    ]
    assert "axplug-moe" in names and "axplug-checkpoint-cloud" in names
    pattern = re.compile(r"\b(" + "|".join(map(re.escape, names)) + r")\b")
    offenders = [
        f"{path.relative_to(ROOT)}:{number}: {found.group(1)}"
        for path in sorted(CORE.rglob("*.py"))
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
        if (found := pattern.search(line))
    ]
    assert not offenders, "\n".join(offenders)


def _plugin_classes() -> set[str]:
    """Names of the classes the first-party plugins define."""
    return {
        node.name
        for path in (ROOT / "plugins").glob("*/axplug_*/**/*.py")
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
        if isinstance(node, ast.ClassDef) and node.name != "Config"
    }


_READS = ("get", "positive_int", "number", "expect", "has", "name")


def _strings(nodes) -> set[str]:
    return {n.value for n in nodes if isinstance(n, ast.Constant) and isinstance(n.value, str)}


def _hf_field_names(paths) -> set[str]:
    """The config.json fields `hf_read` methods (and `read_*` helpers) read
    (`fields.get("x")`, ...) and `hf_write` methods (and `write_*` helpers) write (the keys
    of the dicts they return)."""
    names = set()
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not isinstance(node, ast.FunctionDef):
                continue
            writes = node.name == "hf_write" or node.name.startswith("write_")
            if not (writes or node.name == "hf_read" or node.name.startswith("read_")):
                continue
            helper = not node.name.startswith("hf_")  # only its reads of `fields` count
            for sub in ast.walk(node):
                called = isinstance(sub, ast.Call) and isinstance(sub.func, ast.Attribute)
                if called and helper:
                    called = isinstance(sub.func.value, ast.Name) and sub.func.value.id == "fields"
                if called and sub.func.attr in _READS and sub.args:
                    names |= _strings([sub.args[0]])
                if isinstance(sub, ast.Dict) and writes:
                    names |= _strings(sub.keys)
    return names


def test_the_core_never_names_a_plugin_class_or_a_plugin_layers_hf_field():
    """A model family is a plugin: the core spells neither the classes of a plugin's layers
    nor the config.json fields that only a plugin's layers read and write (but for where a
    class that moved to a plugin was the core's: saved configs name it, `MOVED` maps it)."""
    from axplug.config.serialize import MOVED

    classes = _plugin_classes()
    assert {"RotaryPositionTransform", "MoEFeedForward", "Mixtral"} <= classes
    core_files = sorted(CORE.rglob("*.py"))
    plugin_fields = _hf_field_names((ROOT / "plugins").glob("*/axplug_*/**/*.py"))
    from axplug.api._hf import METADATA_FIELDS

    own_fields = _hf_field_names(core_files) | METADATA_FIELDS  # every model's: the core's
    only_plugins = plugin_fields - own_fields
    assert {"rope_theta", "num_local_experts", "num_experts_per_tok"} <= only_plugins
    offenders = []
    for path in core_files:
        tree = ast.parse(path.read_text(encoding="utf-8"))
        words = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
        words |= {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
        strings = " ".join(
            n.value
            for n in ast.walk(tree)
            if isinstance(n, ast.Constant) and isinstance(n.value, str) and n.value not in MOVED
        )
        # A class by its identifier, or in a string when its name is compound (MoEFeedForward;
        # a model's name in prose, "Mixtral", is not a class).
        compound = {c for c in classes if sum(ch.isupper() for ch in c) > 1}
        named = {c for c in classes if c in words}
        named |= {c for c in compound if re.search(rf"\b{c}\b", strings)}
        named |= {f for f in only_plugins if re.search(rf"\b{f}\b", strings) or f in words}
        offenders += [f"{path.relative_to(ROOT)}: {n}" for n in sorted(named)]
    assert not offenders, "\n".join(offenders)


def _plugin_components() -> dict[str, str]:
    """{component name: its distribution} of every first-party plugin's entry points."""
    import tomllib

    found = {}
    for path in (ROOT / "plugins").glob("*/pyproject.toml"):
        project = tomllib.loads(path.read_text(encoding="utf-8"))["project"]
        for group, entries in project.get("entry-points", {}).items():
            if group.startswith("axplug.") and group != "axplug.plugin_api":
                found.update(dict.fromkeys(entries, project["name"]))
    return found


# Calls whose first string argument names a registered component (or a `name:key=value` spec).
_LOOKUPS = ("load", "entry", "make_modifier", "resolve_preset", "preset_config")


def test_the_core_looks_up_no_plugin_component_and_its_presets_need_none(monkeypatch):
    """No plugin preset, modifier or layer is spelled in a core lookup (LLaMA's RoPE and GQA,
    llama-tiny and the LLaMA family are axplug-attention's), and the core's presets build
    with every plugin disabled."""
    components = _plugin_components()
    assert components["rope"] == components["llama-tiny"] == "axplug-attention"
    offenders = []
    for path in sorted(CORE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not isinstance(node, ast.Call):
                continue
            name = getattr(node.func, "attr", getattr(node.func, "id", ""))
            for arg in node.args[:2] if name in _LOOKUPS else ():
                spec = arg.value if isinstance(arg, ast.Constant) else None
                if isinstance(spec, str) and spec.partition(":")[0] in components:
                    offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}: {spec}")
    assert not offenders, "\n".join(offenders)

    import tomllib

    from axplug import registry
    from axplug.presets import preset_config

    core = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    presets = core["entry-points"]["axplug.presets"]
    assert presets and not set(presets) & set(components)
    monkeypatch.setenv("AXPLUG_LOAD_PLUGINS", "")
    registry.reset()
    try:
        for name in presets:
            preset_config(name, overrides=["output_dir='unused'"])
    finally:
        monkeypatch.delenv("AXPLUG_LOAD_PLUGINS")
        registry.reset()


def test_no_lazy_package_name_is_shadowed_by_its_submodule():
    """A package that reads its names on first use must not have a submodule named like one:
    importing the submodule would set the package attribute to the module."""
    import types

    for package in ("axplug.api", "axplug.interop"):
        pkg = importlib.import_module(package)
        for module in pathlib.Path(pkg.__file__).parent.glob("*.py"):
            importlib.import_module(f"{package}.{module.stem}")
        shadowed = [n for n in pkg.__all__ if isinstance(getattr(pkg, n), types.ModuleType)]
        assert not shadowed, f"{package}: {shadowed} resolve to modules"


def test_the_trainer_does_not_import_the_decode_package():
    """A run directory's checkpoints are found by `axplug.checkpoint`, which the trainer,
    the CLI's config building and loading for inference all use."""
    assert "axplug.inference" not in _core_graph()["axplug.trainer"]


def test_the_plugin_reference_lists_the_floor_and_every_face():
    import axplug
    import axplug.api

    text = (ROOT / "docs" / "plugin-reference.md").read_text()
    assert f"Today the core is at API **{axplug.PLUGIN_API_VERSION}**" in text
    section = text[text.index("## What a plugin imports") : text.index("## How plugins are")]
    missing = [name for name in axplug.api.__all__ if f"`{name}`" not in section]
    faces = set(re.findall(r"`(axplug\.api\.[a-z_]+)`", section))
    assert not missing, f"floor names the page does not list: {missing}"
    assert faces == set(FACES), f"faces listed vs faces in the package: {faces ^ set(FACES)}"


def test_the_architecture_page_floors_match_the_imports():
    """docs/ARCHITECTURE.md's floor table names every core package once, and none imports a
    package on a floor above its own."""
    text = (ROOT / "docs" / "ARCHITECTURE.md").read_text()
    floor = {}
    for number, packages in re.findall(r"^\| (\d+) \| ([^|]+) \|", text, re.M):
        for package in re.findall(r"`([a-z_.]+)`", packages):
            name = package if package == "axplug" else f"axplug.{package}"
            assert name not in floor, f"{package} is on two floors"
            floor[name] = int(number)
    graph = _core_graph()
    assert set(graph) == set(floor), f"packages vs the table: {set(graph) ^ set(floor)}"
    climbs = [
        f"{a} (floor {floor[a]}) -> {b} (floor {floor[b]}) at {where[0]}"
        for a, targets in graph.items()
        for b, where in targets.items()
        if floor[b] > floor[a]
    ]
    assert not climbs, "\n".join(climbs)


def test_a_face_imports_only_the_core_module_a_name_is_read_from():
    """`from axplug.api.config import config_class` must not pay for the presets (and with them
    the trainer, orbax and jax): each face reads a name from its modules on first use."""
    import subprocess
    import sys

    code = (
        "import sys\nfrom axplug.api.config import config_class, REQUIRED\n"
        "from axplug.api.registry import names\n"
        "print(sorted(m for m in ('axplug.presets', 'axplug.trainer', 'jax') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


# The bases that declare their kind's optional members with defaults; callers read them.
DECLARING_BASES = (
    ("axplug.api", "Kernel"),
    ("axplug.api", "HFArchitecture"),
    ("axplug.layers", "BaseLayer"),
    ("axplug.layers", "AttentionKernelSlot"),
    ("axplug.layers", "KVCache"),
    ("axplug.input", "Input"),
    ("axplug.config", "Configurable"),
)
# Names a base declares that are also plain config fields some configs have and others lack
# (a layer config's `dtype`, an input config's `vocab_size`): schema reads, not hooks.
_ALSO_CONFIG_FIELDS = {"dtype", "compute_dtype", "vocab_size", "config"}


def _probes(path: pathlib.Path, names: set[str]) -> list[str]:
    """`getattr(x, "name", ...)` / `hasattr(x, "name")` calls in `path` for any of `names`."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("getattr", "hasattr")
            and len(node.args) >= 2
            and isinstance(node.args[1], ast.Constant)
            and node.args[1].value in names
        ):
            found.append(
                f"{path.relative_to(ROOT)}:{node.lineno}: {node.func.id} {node.args[1].value}"
            )
    return found


def test_optional_members_are_read_from_their_base_never_probed():
    declared = set()
    for module, name in DECLARING_BASES:
        base = getattr(importlib.import_module(module), name)
        declared |= {n for n in vars(base) if not n.startswith("_")}
    declared -= _ALSO_CONFIG_FIELDS
    assert {"paged", "config_fields", "hf_layer_path", "check_config", "extend_paged"} <= declared
    sources = [p for p in CORE.rglob("*.py") if "templates" not in p.parts]
    sources += [path for path, _dist in _plugin_sources()]
    probes = [p for path in sources for p in _probes(path, declared)]
    assert not probes, "read these from the declaring base instead:\n" + "\n".join(probes)


def test_the_probe_check_finds_a_probe(tmp_path):
    path = ROOT / "tests" / "_probe_example.py"
    path.write_text('x = getattr(kernel, "paged", False) or hasattr(arch, "aliases")\n')
    try:
        assert len(_probes(path, {"paged", "aliases"})) == 2
    finally:
        path.unlink()
