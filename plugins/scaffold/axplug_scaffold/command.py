"""`axplug new-plugin NAME`: writes a complete, tested plugin package to start from."""

from __future__ import annotations

import argparse
import keyword
import re
from pathlib import Path
from typing import Any

from axplug.api import add_command

__all__ = ["add_parser", "run", "KINDS", "KIND_GROUPS", "generate", "names_for", "template_files"]

# kind -> (entry-point group, submodule). The files are real templates shipped as package
# data, `templates/<kind>/<submodule>.py.tmpl` and its `test_<submodule>.py.tmpl`, plus
# `templates/common/` for every package; `$placeholders` are filled by string.Template, and
# `make lint` runs ruff on every kind rendered.
KIND_GROUPS = {
    "layer": ("axplug.layers", "layer"),
    "kernel": ("axplug.kernels", "kernel"),
    "mesh-rule": ("axplug.mesh_rules", "mesh_rule"),
    "modifier": ("axplug.modifiers", "modifier"),
    "storage": ("axplug.storage", "storage"),
    "hooks": ("axplug.hooks", "hooks"),
    "command": ("axplug.commands", "command"),
}
KINDS = tuple(KIND_GROUPS)
_COMMON = {  # template -> path in the package
    "pyproject.toml": "pyproject.toml",
    "README.md": "README.md",
    "conftest.py": "tests/conftest.py",
    "__init__.py": "$module/__init__.py",
}

EPILOG = """\
examples:
  axplug new-plugin axplug-sqrelu                  a layer plugin in ./axplug-sqrelu
  axplug new-plugin axplug-acts --component sq_relu --with-modifier
                                                   layer `sq_relu` (class SqRelu) and the
                                                   modifier `sq_relu` that swaps it in
  axplug new-plugin my-attn --kind kernel --dir plugins
  axplug new-plugin axplug-l40s --kind mesh-rule
  cd axplug-sqrelu && pip install -e '.[test]' && pytest && axplug list --kind layers

The package has pyproject.toml (entry points, the plugin API it targets, a dependency on
axplug), a small working component, a README and tests that run the conformance kit
`axplug_testing`.
"""


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    parser = add_command(
        subparsers,
        "new-plugin",
        run,
        help="create a new plugin package from a template",
        description="Write a plugin package: pyproject.toml, a working component, README, tests.",
        epilog=EPILOG,
    )
    parser.add_argument("name", help="distribution name, e.g. axplug-sqrelu")
    parser.add_argument("--kind", choices=KINDS, default="layer", help="default: layer")
    parser.add_argument(
        "--dir", default=".", help="parent directory; the package goes to DIR/NAME (default: .)"
    )
    parser.add_argument(
        "--component",
        metavar="NAME",
        help="the component's registry name (default: from the distribution name); the class "
        "is its CamelCase",
    )
    parser.add_argument(
        "--with-modifier",
        action="store_true",
        help="with --kind layer: also a modifier of the same name that puts the layer in "
        "place of every FeedForward, registered and tested",
    )
    parser.add_argument("--force", action="store_true", help="overwrite an existing directory")
    return parser


def names_for(name: str) -> dict[str, str]:
    """The distribution, module, component and class names derived from `name`."""
    from axplug.api.config import UsageError

    dist = re.sub(r"[-_.\s]+", "-", name.strip()).lower()
    if not re.fullmatch(r"[a-z][a-z0-9-]*[a-z0-9]", dist):
        raise UsageError(
            f"plugin name {name!r}: use letters, digits and dashes, starting with a letter "
            "(e.g. axplug-sqrelu)"
        )
    module = dist.replace("-", "_")
    if keyword.iskeyword(module) or module == "axplug":
        raise UsageError(f"plugin name {name!r}: {module!r} cannot be a package name")
    short = module[len("axplug_") :] if module.startswith("axplug_") else module
    cls = "".join(part.capitalize() for part in short.split("_"))
    return {"dist": dist, "module": module, "name": short, "cls": cls}


def generate(
    name: str,
    kind: str,
    directory: Path,
    *,
    force: bool = False,
    component: str | None = None,
    with_modifier: bool = False,
) -> list[Path]:
    """Writes the package for `name` to directory/<dist>; returns the files written."""
    from string import Template

    from axplug.api import CORE_VERSION, PLUGIN_API_VERSION
    from axplug.api.config import UsageError

    if kind not in KIND_GROUPS:
        raise UsageError(f"unknown kind {kind!r}; choose from {', '.join(KIND_GROUPS)}")
    if with_modifier and kind != "layer":
        raise UsageError(f"--with-modifier goes with --kind layer, not {kind!r}")
    group, submodule = KIND_GROUPS[kind]
    values = names_for(name)
    if component is not None:
        if not re.fullmatch(r"[a-z][a-z0-9_]*", component) or keyword.iskeyword(component):
            raise UsageError(
                f"--component {component!r}: use lowercase letters, digits and underscores, "
                "starting with a letter (e.g. sq_relu)"
            )
        values["name"] = component
        values["cls"] = "".join(part.capitalize() for part in component.split("_"))
    major, minor = CORE_VERSION.split(".")[:2]
    api_major = PLUGIN_API_VERSION.split(".")[0]
    values.update(
        group=group,
        submodule=submodule,
        kind=group.split(".", 1)[1],
        api=api_major,  # the entry name loading reads; the minor goes in the requirement
        axplug_req=f"axplug>={CORE_VERSION},<{major}.{int(minor) + 1}",
        description=f"An axplug {kind} plugin: {values['name']}.",
    )
    values["func"] = f"{values['name']}_rule"
    values["selector"] = values["name"].replace("_", "-")
    exports = {"mesh-rule": values["func"], "command": "add_parser"}
    values["export"] = exports.get(kind, values["cls"])
    target = f"{values['module']}.{submodule}"
    exported = "plugin" if kind == "hooks" else values["export"]
    # A command's entry names its module (add_parser and run), not an object in it.
    values["entry_value"] = target if kind == "command" else f"{target}:{exported}"
    values["extra_entry_points"] = (
        f'\n[project.entry-points."axplug.modifiers"]\n'
        f'{values["name"]} = "{values["module"]}.modifier:{values["cls"]}Modifier"\n'
        if with_modifier
        else ""
    )
    root = Path(directory) / values["dist"]
    if root.exists() and any(root.iterdir()) and not force:
        raise UsageError(f"{root} exists and is not empty; pass --force to overwrite")
    files = {
        root / Template(rel).substitute(values): Template(text).substitute(values)
        for rel, text in template_files(kind, with_modifier).items()
    }
    _write_package(root, files)
    return list(files)


def _write_package(root: Path, files: dict[Path, str]) -> None:
    """Writes `files` (all under `root`) into a temporary directory beside `root`, then moves
    them into place: a failed write (a full disk) leaves nothing behind."""
    import os
    import shutil

    created = [p for p in (root.parent, *root.parent.parents) if not p.exists()]
    root.parent.mkdir(parents=True, exist_ok=True)
    staging = root.parent / f".{root.name}.tmp-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    try:
        for path, text in files.items():
            staged = staging / path.relative_to(root)
            staged.parent.mkdir(parents=True, exist_ok=True)
            staged.write_text(text)
        if root.is_dir() and not any(root.iterdir()):
            root.rmdir()
        if not root.exists():
            os.replace(staging, root)
            return
        for path in files:  # --force over a package: its files replaced, any others kept
            path.parent.mkdir(parents=True, exist_ok=True)
            os.replace(staging / path.relative_to(root), path)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        for parent in created:  # innermost first: the directories this call made, if empty
            if parent.is_dir() and not any(parent.iterdir()):
                parent.rmdir()
        raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def template_files(kind: str, with_modifier: bool = False) -> dict[str, str]:
    """{path in the package (with `$module`): template text} for a plugin of `kind`."""
    from importlib.resources import files

    templates = files("axplug_scaffold").joinpath("templates")
    submodule = KIND_GROUPS[kind][1]
    own = [(kind, submodule, "$module")]
    if with_modifier:
        own.append(("layer", "modifier", "$module"))
    out = {
        rel: templates.joinpath("common", f"{name}.tmpl").read_text()
        for name, rel in _COMMON.items()
    }
    for directory, module, package in own:
        folder = templates.joinpath(directory)
        out[f"{package}/{module}.py"] = folder.joinpath(f"{module}.py.tmpl").read_text()
        out[f"tests/test_{module}.py"] = folder.joinpath(f"test_{module}.py.tmpl").read_text()
    return out


def run(args: argparse.Namespace) -> int:

    written = generate(
        args.name,
        args.kind,
        Path(args.dir),
        force=args.force,
        component=args.component,
        with_modifier=args.with_modifier,
    )
    root = written[0].parent
    what = f"{args.kind} + modifier" if args.with_modifier else args.kind
    print(f"created {what} plugin in {root}:")
    for path in written:
        print(f"  {path.relative_to(root)}")
    print(f"\nnext: cd {root} && pip install -e '.[test]' && pytest && axplug list")
    return 0
