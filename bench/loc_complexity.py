"""LoC-complexity of a feature: the lines a user changes to get RoPE or MoE, and the lines of
the core that adding the attention and MoE plugins changed, both counted with git.

    python bench/loc_complexity.py

**User lines.** A run is described by its *recipe*: the preset's name and its modifier specs,
one per line, exactly what `axplug train --preset P --modifier SPEC ...` takes (or
`preset_config(P, modifiers=[...])`). For every registered preset the script writes the
recipe of the preset and of its RoPE variant (`rope` added unless the preset already has
RoPE) and of its MoE variant (`moe:num_experts=8,top_k=2` added unless it already has
experts), and counts the changed lines with `git diff --no-index --numstat`. Every variant
config is built and checked to contain the feature (a RotaryPositionTransform, a
MoEFeedForward), so a count can't come from a recipe that doesn't work.

**Core lines.** The commits that added `plugins/attention` and `plugins/ffn_moe` (the first
commit of each `pyproject.toml`, from `git log --follow --diff-filter=A`), and their
`git diff --numstat` restricted to `core/`.

**Model families.** For every installed architecture (`axplug.architectures`): the code lines
of its contribution (the architecture class and the module-level helpers of its file, counted
with `tokenize`: no blank, comment or docstring lines), and the core lines changed by the
commit that registered it (the first commit whose pyproject.toml has its entry, `git log -S`).
A family that arrives after its modality's mechanism registers with 0, so for each modality
plugin (`MODALITIES`) the script also sums the core lines of every commit that touched the
plugin's directory: what its mechanisms cost the core (an upper bound: such a commit may
change the core for other reasons too).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from typing import Any

__all__ = [
    "VARIANTS",
    "PLUGINS",
    "variant_specs",
    "count_changed_lines",
    "core_lines",
    "family_lines",
    "MODALITIES",
    "distribution_core_lines",
    "main",
]

# feature -> (modifier added, the config class that shows the feature is there)
VARIANTS = {
    "rope": ("rope", "RotaryPositionTransform"),
    "moe": ("moe:num_experts=8,top_k=2", "MoEFeedForward"),
}
PLUGINS = {"axplug-attention": "plugins/attention", "axplug-moe": "plugins/ffn_moe"}
MODALITIES = {"axplug-vision": "plugins/vision"}  # a second modality's core mechanisms
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _git(*args: str, check: bool = True) -> str:
    proc = subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True)
    if check and proc.returncode:
        raise RuntimeError(f"git {' '.join(args)} failed: {proc.stderr.strip()}")
    return proc.stdout


def _has(cfg: Any, class_name: str) -> bool:
    from axplug.config import visit

    found = []
    visit(cfg, lambda _p, v: found.append(getattr(getattr(v, "klass", None), "__name__", "")))
    return class_name in found


def recipe(preset: str, modifiers: list[str]) -> str:
    """The recipe text: the preset line, then one line per modifier spec."""
    return "".join(f"{line}\n" for line in [f"preset {preset}", *modifiers])


def variant_specs(preset: str, feature: str) -> list[str]:
    """The modifier specs a user adds to `preset` to get `feature`; [] if it has it already.

    Raises RuntimeError if the variant config does not contain the feature.
    """
    from axplug.presets import preset_config

    spec, class_name = VARIANTS[feature]
    if _has(preset_config(preset), class_name):
        return []
    added = [spec]
    if not _has(preset_config(preset, modifiers=added), class_name):
        raise RuntimeError(f"preset {preset} with {added} has no {class_name}")
    return added


def count_changed_lines(before: str, after: str) -> tuple[int, int]:
    """(added, deleted) lines between two texts, from `git diff --no-index --numstat`."""
    with tempfile.TemporaryDirectory() as tmp:
        a, b = os.path.join(tmp, "a"), os.path.join(tmp, "b")
        for path, text in ((a, before), (b, after)):
            with open(path, "w") as f:
                f.write(text)
        out = _git("diff", "--no-index", "--numstat", a, b, check=False).split()
    return (int(out[0]), int(out[1])) if out else (0, 0)


def core_lines(plugin_dir: str) -> tuple[str, str, list[tuple[int, int, str]]]:
    """(commit, subject, [(added, deleted, path)] under core/) of the commit adding a plugin."""
    log = _git(
        "log", "--follow", "--diff-filter=A", "--format=%h %s", "--", f"{plugin_dir}/pyproject.toml"
    ).splitlines()
    if not log:
        raise RuntimeError(f"no commit adds {plugin_dir}/pyproject.toml in this repository")
    commit, _, subject = log[-1].partition(" ")
    return commit, subject, _core_rows(commit)


def _code_lines(path: str) -> int:
    """Lines of `path` holding code: not blank, not only a comment, not a docstring."""
    import io
    import tokenize

    lines: set[int] = set()
    previous = tokenize.INDENT
    with open(path, encoding="utf-8") as f:
        tokens = list(tokenize.generate_tokens(io.StringIO(f.read()).readline))
    for tok in tokens:
        kind = tok.type
        if kind == tokenize.STRING and previous in (tokenize.INDENT, tokenize.NEWLINE, tokenize.NL):
            previous = kind  # a docstring (an expression statement of one string)
            continue
        if kind not in (tokenize.NL, tokenize.NEWLINE, tokenize.COMMENT, tokenize.INDENT,
                        tokenize.DEDENT, tokenize.ENDMARKER):  # fmt: skip
            lines.update(range(tok.start[0], tok.end[0] + 1))
        previous = kind
    return len(lines)


def _core_rows(commit: str) -> list[tuple[int, int, str]]:
    """[(added, deleted, path)] of one commit under core/ (git diff --numstat)."""
    rows = []
    for line in _git("diff", "--numstat", f"{commit}^", commit, "--", "core/").splitlines():
        added, deleted, path = line.split("\t")
        rows.append((int(added), int(deleted), path))
    return rows


def _core_numstat(commit: str) -> tuple[int, int]:
    """(core lines added, deleted) by one commit."""
    rows = _core_rows(commit)
    return sum(r[0] for r in rows), sum(r[1] for r in rows)


def family_lines() -> list[tuple[str, str, int, int, int]]:
    """(architecture, distribution, contribution code lines, core +, core -) per family."""
    import inspect

    from axplug import registry

    rows = []
    for name in registry.names("architectures"):
        component = registry.entry("architectures", name)
        obj = registry.load("architectures", name)
        source = inspect.getsourcefile(obj if isinstance(obj, type) else type(obj))
        log = _git("log", "--format=%h", "-S", f"{name} =", "--", "pyproject.toml",
                   "plugins/*/pyproject.toml").split()  # fmt: skip
        plus, minus = _core_numstat(log[-1]) if log else (0, 0)
        rows.append((name, component.distribution, _code_lines(source), plus, minus))
    return rows


def distribution_core_lines(directory: str) -> tuple[int, int, int]:
    """(commits, core lines added, deleted) of every commit that touched `directory`."""
    commits = _git("log", "--format=%h", "--", directory).split()
    totals = [_core_numstat(c) for c in commits]
    return len(commits), sum(t[0] for t in totals), sum(t[1] for t in totals)


def main(argv: list[str] | None = None) -> int:
    del argv
    from axplug import registry
    from axplug.presets import resolve_preset

    print("lines a user changes (recipe = preset + one line per modifier; git diff --numstat)")
    print(f"{'preset':14} {'RoPE variant':>12} {'MoE variant':>12}  added modifier lines")
    for name in registry.names("presets"):
        base = list(resolve_preset(name).modifiers)
        cells, notes = [], []
        for feature in VARIANTS:
            added = variant_specs(name, feature)
            plus, minus = count_changed_lines(recipe(name, base), recipe(name, base + added))
            cells.append(f"{plus + minus}" + ("" if added else " (has)"))
            notes += added
        print(f"{name:14} {cells[0]:>12} {cells[1]:>12}  {', '.join(notes) or '-'}")

    print("\nlines of core/ changed by the commits that added the plugins (git diff --numstat)")
    print(f"{'plugin':18} {'commit':8} {'core +':>7} {'core -':>7}  files")
    for dist, directory in PLUGINS.items():
        commit, subject, rows = core_lines(directory)
        plus, minus = sum(r[0] for r in rows), sum(r[1] for r in rows)
        files = ", ".join(f"{p} (+{a}/-{d})" for a, d, p in rows) or "-"
        print(f"{dist:18} {commit:8} {plus:7d} {minus:7d}  {files}")
        print(f"{'':18} {subject[:90]}")

    print("\nmodel families: code lines of the contribution's file; core lines its commit changed")
    print(f"{'architecture':22} {'distribution':14} {'lines':>6} {'core +':>7} {'core -':>7}")
    families = family_lines()
    for arch, dist, lines, plus, minus in families:
        print(f"{arch:22} {dist:14} {lines:6d} {plus:7d} {minus:7d}")

    print(
        "\na modality's mechanisms: core lines of every commit that touched its plugin "
        "(an upper bound)"
    )
    print(f"{'modality plugin':22} {'commits':>7} {'core +':>7} {'core -':>7}  families")
    for dist, directory in MODALITIES.items():
        commits, plus, minus = distribution_core_lines(directory)
        names = ", ".join(row[0] for row in families if row[1] == dist)
        print(f"{dist:22} {commits:7d} {plus:7d} {minus:7d}  {names}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
