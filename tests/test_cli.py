"""`axplug list` and `axplug info`, in-process and as a real command in a subprocess."""

import argparse
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from axplug_testing import tiny_train_args

from axplug import __version__
from axplug.cli import main
from axplug.config.tree import ChainConfigModifier
from fake_plugins import LAYER, STORAGE

DENSE = LAYER
TINY = """
from axplug.presets import Preset, gpt_tiny

TINY = Preset("fake-a:tiny", "A fake preset.", gpt_tiny.build)
"""
PLAIN_KERNEL = '''
class Dense:
    """A fake dense layer."""

    def is_supported(self, query, key, value, mask, backend):
        return True

    def __call__(self, query, key, value, mask, *, scale):
        raise NotImplementedError
'''
EXPLODES = "raise RuntimeError('boom')\n"
JSON_KEYS = {
    "distribution",
    "version",
    "kind",
    "name",
    "status",
    "reason",
    "entry_point",
    "description",
}


def _axplug(site, *args, command=(sys.executable, "-m", "axplug.cli"), **env):
    return subprocess.run(
        [*command, *args], env=site.env(**env), capture_output=True, text=True, timeout=120
    )


def _json(capsys, *args):
    assert main([*args, "--json"]) in (0, 1)
    return json.loads(capsys.readouterr().out)


def _rows(rows, distribution):
    return [r for r in rows if r["distribution"] == distribution]


def test_list_json_contract_in_a_subprocess(plugin_site):
    plugin_site.add(
        "fake-a",
        {"axplug.layers": {"dense": "fake_a_mod:Dense"}},
        version="2.3",
        modules={"fake_a_mod": DENSE},
    )
    result = _axplug(plugin_site, "list", "--json")
    assert result.returncode == 0, result.stderr
    rows = json.loads(result.stdout)
    assert all(set(row) == JSON_KEYS for row in rows)
    assert _rows(rows, "fake-a") == [
        {
            "distribution": "fake-a",
            "version": "2.3",
            "kind": "layers",
            "name": "dense",
            "status": "ok",
            "reason": None,
            "entry_point": "fake_a_mod:Dense",
            "description": "A fake dense layer.",
        }
    ]
    assert {"linear", "rms_norm"} <= {r["name"] for r in _rows(rows, "axplug")}


def test_console_script_lists_the_fake_plugin(plugin_site):
    script = Path(sys.executable).with_name("axplug")
    if not script.exists():
        pytest.skip(f"console script not installed at {script}; run pip install -e .")
    plugin_site.add("fake-a", {"axplug.kernels": {"flash": "fake_a_mod:Dense"}})
    result = _axplug(plugin_site, "list", "--kind", "kernels", "--json", command=(str(script),))
    assert result.returncode == 0, result.stderr
    assert [(r["distribution"], r["name"]) for r in json.loads(result.stdout)] == [
        ("axplug", "blockwise"),
        ("axplug", "paged_xla"),
        ("axplug", "reference"),
        ("axplug", "xla"),
        ("fake-a", "flash"),
    ]


def test_list_imports_neither_plugins_nor_jax(plugin_site):
    plugin_site.add(
        "fake-a",
        {"axplug.layers": {"dense": "fake_a_mod:Dense"}},
        modules={"fake_a_mod": "import jax\n" + DENSE},
    )
    code = (
        "import sys\n"
        "from axplug.cli import main\n"
        "assert main(['list']) == 0 and main(['list', '--json']) == 0\n"
        "assert main(['--help']) == 0 and main(['list', '--help']) == 0\n"
        "loaded = [m for m in ('jax', 'fake_a_mod', 'axplug.layers') if m in sys.modules]\n"
        "print('LOADED', loaded)\n"
    )
    result = _axplug(plugin_site, "-c", code, command=(sys.executable,))
    assert result.returncode == 0, result.stderr
    assert "fake-a" in result.stdout
    assert "LOADED []" in result.stdout


def test_list_kind_filters(plugin_site, capsys):
    plugin_site.add("fake-a", {"axplug.layers": {"dense": "m:D"}, "axplug.modifiers": {"w": "m:f"}})
    rows = _json(capsys, "list", "--kind", "modifiers")
    assert {r["kind"] for r in rows} == {"modifiers"}
    assert [(r["distribution"], r["name"]) for r in rows if r["distribution"] != "axplug"] == [
        ("fake-a", "w")
    ]


def test_list_rejects_an_unknown_kind_listing_the_valid_ones(plugin_site, capsys):
    assert main(["list", "--kind", "layer"]) == 2
    err = capsys.readouterr().err
    assert "invalid choice: 'layer'" in err and "'layers', 'modifiers', 'kernels'" in err


def test_list_table_shows_every_status_and_never_fails(plugin_site, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "250")
    plugin_site.add("fake-a", {"axplug.kernels": {"rope": "m:D", "flash": "m:D"}})
    plugin_site.add("fake-b", {"axplug.kernels": {"rope": "m:D"}})
    plugin_site.add("fake-old", {"axplug.kernels": {"splash": "m:D"}}, api="2")
    assert main(["--disable", "fake-a", "list", "--kind", "kernels"]) == 0
    table = capsys.readouterr().out
    assert "disabled: AXPLUG_DISABLE_PLUGINS lists it" in table
    api = f"incompatible: declares plugin API 2; axplug {__version__} supports plugin API 1"
    assert api in table
    assert main(["list", "--kind", "kernels"]) == 0
    table = capsys.readouterr().out  # not a terminal: plain columns
    header = ["DISTRIBUTION", "VERSION", "KIND", "NAME", "STATUS", "DESCRIPTION"]
    assert table.splitlines()[0].split() == header
    lines = {line.split()[3]: line for line in table.splitlines() if line.startswith("fake")}
    assert "conflict" in lines["rope"] and "fake-old" in lines["splash"]
    assert "unchecked" in lines["flash"]  # a plugin's kernel: runs here? only --check knows
    monkeypatch.setattr("sys.stdout.isatty", lambda: True)  # a terminal: the rich table
    assert main(["list", "--kind", "kernels"]) == 0
    table = capsys.readouterr().out
    lines = {line.split("│")[4].strip(): line for line in table.splitlines() if "│ fake" in line}
    assert "conflict" in lines["rope"] and "fake-old" in lines["splash"]
    assert "unchecked" in lines["flash"]


def test_list_by_dist_fits_the_terminal_and_keeps_names_whole(plugin_site, capsys, monkeypatch):
    """`make demo` prints it first: 240 columns once, its columns now wrap to the width."""
    monkeypatch.setenv("COLUMNS", "100")
    monkeypatch.setattr("sys.stdout.isatty", lambda: True)
    kinds = ("layers", "modifiers", "kernels", "presets", "commands", "inputs", "hooks")
    plugin_site.add(
        "fake-many-kinds-of-components", {f"axplug.{k}": {f"{k}_x": "m:D"} for k in kinds}
    )
    assert main(["list", "--by-dist"]) == 0
    lines = re.sub(r"\x1b\[[0-9;]*m", "", capsys.readouterr().out).splitlines()  # styles
    assert max(map(len, lines)) <= 100
    rows = [line for line in lines if line.startswith("│ fake-many-kinds-of-components")]
    assert len(rows) == 1  # the name whole, on its row; the counts wrapped below it
    table = "".join(line.split("│")[3] for line in lines if line.startswith("│"))
    assert all(f"1 {kind}" in " ".join(table.split()) for kind in kinds)


KERNEL = '''
class Kernel:
    """A fake kernel for tests. It runs nowhere."""

    def availability(self):
        return "needs a fake accelerator"

    def is_supported(self, query, key, value, mask, backend):
        return True

    def __call__(self, query, key, value, mask, *, scale):
        raise NotImplementedError
'''


def test_list_describes_components_from_source_and_counts_distributions(plugin_site, capsys):
    plugin_site.add(
        "fake-a",
        {"axplug.kernels": {"k": "fake_k:Kernel"}, "axplug.layers": {"dense": "fake_a_mod:Dense"}},
        modules={"fake_k": KERNEL, "fake_a_mod": DENSE},
    )
    rows = {r["name"]: r for r in _json(capsys, "list")}
    assert rows["k"]["description"] == "A fake kernel for tests."  # the first sentence
    assert rows["k"]["status"] == "unchecked"
    assert rows["rms_norm"]["description"].startswith("x / rms(x) * (scale + scale_offset)")
    assert rows["mesh"]["description"].endswith("e.g. `mesh:fsdp=-1,model=2`.")  # not cut at e.g.
    # A preset is an object built by a call: its description argument.
    assert rows["gpt-tiny"]["description"].startswith("2-layer GPT on bytes")
    assert rows["cpu"]["description"] == "Data parallel over every CPU device."
    checked = {r["name"]: r for r in _json(capsys, "list", "--check")}
    assert checked["k"]["status"] == "unavailable"
    assert checked["k"]["reason"] == "needs a fake accelerator"
    assert checked["cpu"]["description"] == "cpu-*: Data parallel over every CPU device."

    # Edited source: the cached description follows the file (size and mtime key the cache).
    module = next(plugin_site.path.rglob("fake_k.py"))
    module.write_text(KERNEL.replace("A fake kernel for tests.", "A renamed kernel, longer."))
    rows = {r["name"]: r for r in _json(capsys, "list")}
    assert rows["k"]["description"] == "A renamed kernel, longer."

    by_dist = {r["distribution"]: r for r in _json(capsys, "list", "--by-dist")}
    assert by_dist["fake-a"]["components"] == "2: 1 kernels, 1 layers"
    assert by_dist["fake-a"]["status"] == "1 unchecked, 1 ok"
    core_count = sum(1 for r in _json(capsys, "list") if r["distribution"] == "axplug")
    assert by_dist["axplug"]["components"].startswith(f"{core_count}: ")
    assert main(["list", "--by-dist"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["DISTRIBUTION", "VERSION", "COMPONENTS", "STATUS", "SUMMARY"]
    assert any(line.startswith("fake-a ") for line in lines)


def test_disable_flag_does_not_leak_into_the_process(plugin_site, capsys):
    import os

    plugin_site.add("fake-a", {"axplug.kernels": {"flash": "m:D"}})
    (row,) = _rows(_json(capsys, "--disable", "Fake_A", "list", "--kind", "kernels"), "fake-a")
    assert row["status"] == "disabled"
    assert "AXPLUG_DISABLE_PLUGINS" not in os.environ


def test_check_imports_each_component_and_fails_on_broken(plugin_site, capsys):
    plugin_site.add(
        "fake-good",
        {"axplug.storage": {"mem": "fake_good_mod:Dense"}},
        modules={"fake_good_mod": STORAGE},
    )
    plugin_site.add(
        "fake-bad",
        {"axplug.storage": {"s3": "fake_bad_mod:S3"}},
        modules={"fake_bad_mod": EXPLODES},
    )
    rows = [r for r in _json(capsys, "list", "--kind", "storage") if r["distribution"] != "axplug"]
    assert {r["name"]: r["status"] for r in rows} == {"mem": "ok", "s3": "ok"}
    assert "fake_bad_mod" not in sys.modules
    assert main(["list", "--kind", "storage", "--check", "--json"]) == 1
    rows = [r for r in json.loads(capsys.readouterr().out) if r["distribution"] != "axplug"]
    assert {r["name"]: (r["status"], r["reason"]) for r in rows} == {
        "mem": ("ok", None),
        "s3": ("broken", "RuntimeError: boom"),
    }
    assert main(["--disable", "fake-bad", "list", "--kind", "storage", "--check"]) == 0


def test_check_rejects_hooks_the_core_does_not_define(plugin_site, capsys):
    source = "from axplug.api import hookimpl\n\n@hookimpl\ndef on_epoch_end(trainer):\n    pass\n"
    plugin_site.add(
        "fake-hooks", {"axplug.hooks": {"h": "fake_hooks_mod"}}, modules={"fake_hooks_mod": source}
    )
    assert main(["list", "--kind", "hooks"]) == 0
    capsys.readouterr()
    assert main(["list", "--kind", "hooks", "--check", "--json"]) == 1
    (row,) = json.loads(capsys.readouterr().out)
    assert row["status"] == "broken" and "unknown hook(s) on_epoch_end" in row["reason"]


def test_info_prints_source_doc_and_default_config(plugin_site, capsys):
    plugin_site.add(
        "fake-a",
        {"axplug.modifiers": {"chain": "axplug.config.tree:ChainConfigModifier"}},
        version="0.7",
    )
    assert main(["info", "chain"]) == 0
    out = capsys.readouterr().out
    lines = [line.strip() for line in out.splitlines()]
    assert "distribution:  fake-a 0.7" in lines
    assert "entry point:   axplug.config.tree:ChainConfigModifier" in lines
    assert "kind:          modifiers" in lines
    assert "status:        ok" in lines
    assert "doc:           Applies its modifiers in order." in lines
    expected = ChainConfigModifier.default_config().debug_string().splitlines()
    assert expected and lines[lines.index("default config:") + 1 :] == expected


def test_info_without_default_config_shows_the_docstring(plugin_site, capsys):
    plugin_site.add(
        "fake-a",
        {"axplug.kernels": {"dense": "fake_a_mod:Dense"}},
        modules={"fake_a_mod": PLAIN_KERNEL},
    )
    assert main(["info", "fake-a:dense"]) == 0
    out = capsys.readouterr().out
    assert "doc:           A fake dense layer." in out and "default config" not in out


def test_info_unknown_name_suggests(plugin_site, capsys):
    plugin_site.add("fake-a", {"axplug.kernels": {"flash_attention": "m:D"}})
    assert main(["info", "flash_atention"]) == 2
    assert "did you mean 'flash_attention'" in capsys.readouterr().err


def test_info_asks_for_kind_or_distribution_when_ambiguous(plugin_site, capsys):
    plugin_site.add(
        "fake-a",
        {
            "axplug.kernels": {"rope": "fake_a_mod:Dense"},
            "axplug.presets": {"tiny": "fake_a_mod:TINY"},
        },
        modules={"fake_a_mod": DENSE + TINY},
    )
    plugin_site.add(
        "fake-b", {"axplug.storage": {"rope": "m:D"}, "axplug.presets": {"tiny": "m:D"}}
    )
    assert main(["info", "rope"]) == 2
    assert "--kind kernels" in capsys.readouterr().err
    assert main(["info", "rope", "--kind", "kernels"]) == 0
    assert "fake-a 1.0" in capsys.readouterr().out
    assert main(["info", "tiny"]) == 2
    assert "'fake-a:tiny', 'fake-b:tiny'" in capsys.readouterr().err
    assert main(["info", "fake-a:tiny"]) == 0


def test_info_on_a_broken_plugin_reports_it(plugin_site, capsys):
    plugin_site.add(
        "fake-bad", {"axplug.kernels": {"k": "fake_bad_mod:K"}}, modules={"fake_bad_mod": EXPLODES}
    )
    assert main(["info", "k"]) == 1
    assert "status:        broken: RuntimeError: boom" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("argv", "example"),
    [
        (["--help"], "axplug list --kind layers --json"),
        (["list", "--help"], "axplug list --check"),
        (["info", "--help"], "axplug info axplug:rms_norm"),
    ],
)
def test_help_teaches_usage_with_examples(capsys, argv, example):
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "examples:" in out and example in out


def test_no_command_prints_usage(capsys):
    assert main([]) == 2
    assert "usage: axplug" in capsys.readouterr().err


@pytest.mark.parametrize(
    "setting, message",
    [
        (["--checkpoint-every", "0"], "error: checkpoint_every: must be >= 1, got 0"),
        (["--set", "input.batch_size=0"], "error: input.batch_size: must be >= 1, got 0"),
        (
            ["--set", "input.path='/nonexistent.txt'"],
            "error: input.path: file '/nonexistent.txt' does not exist",
        ),
    ],
    ids=["checkpoint_every", "batch_size", "path"],
)
def test_train_settings_errors_are_one_line(tmp_path, capsys, setting, message):
    argv = ["train", "--preset", "gpt-tiny", "--output-dir", str(tmp_path), *setting]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
    assert not (tmp_path / "checkpoints").exists()  # nothing was trained or written


def test_modifier_spec_mistakes_are_named(capsys):
    from axplug.config import ConfigError
    from axplug.modifiers import make_modifier

    with pytest.raises(ConfigError, match=r"expected key=value after 'rope:', e.g. rope:theta="):
        make_modifier("rope:theta")
    with pytest.raises(ConfigError, match="'theta' is given twice"):
        make_modifier("rope:theta=1,theta=2")


def test_print_config_needs_no_output_dir_and_training_does(capsys):
    assert main(["train", "--preset", "gpt-tiny", "--print-config"]) == 0
    assert "model.decoder.vocab_size: 256" in capsys.readouterr().out
    assert main(["train", "--preset", "gpt-tiny"]) == 2
    assert "--output-dir is required" in capsys.readouterr().err


def test_info_of_a_preset_shows_its_description_modifiers_and_config(capsys):
    assert main(["info", "llama-tiny"]) == 0
    out = capsys.readouterr().out
    assert "description:   4-layer LLaMA recipe on bytes" in out
    assert "modifier:      rope  (from axplug-attention)" in out
    # The effective config: RoPE is in it, so the modifier was applied.
    assert "RotaryPositionTransform" in out and "`build()` gives" not in out


def test_one_boundary_prints_axplug_errors_in_a_line_and_tracebacks_on_request(
    monkeypatch, tmp_path, capsys
):
    from axplug.checkpoint import CheckpointError
    from axplug.trainer import NonFiniteError, run

    args = ["train", "--preset", "gpt-tiny", "--output-dir", str(tmp_path), "--mesh-rule", "none"]
    for error, code in ((CheckpointError("saving step 4 failed: disk full"), 1),
                        (NonFiniteError("stopping at step 9: 3 non-finite steps"), 1)):  # fmt: skip
        monkeypatch.setattr(
            run, "train", lambda cfg, error=error, **_: (_ for _ in ()).throw(error)
        )
        assert main(args) == code
        err = capsys.readouterr().err
        assert err.strip().splitlines()[-1] == f"error: {error}"
    monkeypatch.setenv("AXPLUG_TRACEBACK", "1")
    with pytest.raises(NonFiniteError):
        main(args)
    monkeypatch.setattr(run, "train", lambda cfg, **_: 1 / 0)  # a bug is never hidden
    monkeypatch.delenv("AXPLUG_TRACEBACK")
    with pytest.raises(ZeroDivisionError):
        main(args)


def test_real_failures_end_in_one_error_line(tmp_path, capsys):
    def train(out, max_steps, *overrides):
        args = tiny_train_args(out, *overrides, max_steps=max_steps)
        return main([*args, "--mesh-rule", "none", "-q"])

    assert train(tmp_path / "nan", 8, "learner.learning_rate=1e30") == 1
    err = capsys.readouterr().err
    last = err.strip().splitlines()[-1]
    assert last.startswith("error: stopping at step 5: 3 consecutive steps had a non-finite")
    assert "Traceback" not in err

    run = tmp_path / "run"
    assert train(run, 1) == 0
    capsys.readouterr()
    assert train(run, 2, "model.decoder.dim=48") == 2
    err = capsys.readouterr().err
    (line,) = err.strip().splitlines()
    assert line.startswith("error: ") and "resumes from step 1, whose model differs" in line
    assert "model.decoder.dim: saved 32, now 48" in line and "--allow-config-change" in line
    # Let through, the checkpoint's arrays still cannot go into the other model: named too.
    args = tiny_train_args(run, "model.decoder.dim=48", max_steps=2)
    assert main([*args, "--mesh-rule", "none", "-q", "--allow-config-change"]) == 1
    err = capsys.readouterr().err
    assert "params/decoder/embedding/weight: saved float32[256, 32], here float32[256, 48]" in err


def test_train_logs_reach_stderr_and_quiet_silences_them(tmp_path, capsys):
    overrides = ("model.decoder.transformer.num_layers=1", "input.seq_len=16")
    args = tiny_train_args(tmp_path, *overrides, max_steps=1)
    assert main(args) == 0
    capsys.readouterr()
    assert main(args) == 0  # again: resumed, nothing to train; both said on stderr
    err = capsys.readouterr().err
    assert "INFO axplug.trainer: resumed from step 1 of" in err
    assert "already at step 1 of max_steps 1: nothing to train" in err
    assert main([*args, "-q"]) == 0
    assert "resumed from step" not in capsys.readouterr().err


def test_metrics_prints_the_last_records_and_plots_them(tmp_path, capsys):
    from axplug_metrics.command import series

    from axplug.summary import JsonlWriter

    writer = JsonlWriter.default_config().set(dir=str(tmp_path)).instantiate()
    for step, loss in ((10, 3.0), (20, float("nan")), (30, 1.0), (40, 2.0)):
        writer.write(step, {"loss": loss, "learning_rate": 0.1 * step})
    writer.close()
    assert series([{"step": 1, "x": 1.0}, {"step": 2, "x": "nan"}, {"step": 3}], "x") == (
        [1],
        [1.0],
    )
    assert main(["metrics", str(tmp_path), "--last", "2", "--plot", "loss,grad_norm"]) == 0
    out = capsys.readouterr().out
    table = out.split("\n\n")[0].splitlines()
    assert table[0].split() == ["step", "loss", "learning_rate"]
    assert [row.split()[0] for row in table[1:]] == ["30", "40"]  # the last two records
    assert "loss" in out and "3.00┤" in out and "1.00┤" in out  # the axis spans the data
    assert "(no grad_norm in these records)" in out
    assert main(["metrics", str(tmp_path / "nowhere")]) == 1
    assert "no metrics records in" in capsys.readouterr().err


def png_size(path) -> tuple[int, int]:
    """(width, height) from a PNG's signature and IHDR chunk."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
    return int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")


def test_metrics_png_is_an_image_of_the_plots(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    import matplotlib.image
    from axplug_metrics.command import PNG_ROW_HEIGHT, PNG_WIDTH

    from axplug.summary import JsonlWriter

    with JsonlWriter.default_config().set(dir=str(tmp_path)).instantiate() as writer:
        for step in range(1, 21):
            writer.write(step, {"loss": 5.0 / step, "grad_norm": 1.0 + step % 3})
    png = tmp_path / "curves.png"
    assert main(["metrics", str(tmp_path), "--plot", "loss,grad_norm,mfu", "--png", str(png)]) == 0
    assert f"wrote {png}" in capsys.readouterr().out
    assert png_size(png) == (PNG_WIDTH, 2 * PNG_ROW_HEIGHT)  # a row per metric it has
    pixels = matplotlib.image.imread(png)
    assert pixels.shape[:2] == (2 * PNG_ROW_HEIGHT, PNG_WIDTH)
    dark = (pixels[..., :3].mean(axis=-1) < 0.5).mean()
    assert 0.001 < dark < 0.3  # axes, labels and curves drawn; not blank, not filled
    assert main(["metrics", str(tmp_path), "--plot", "none", "--png", str(png)]) == 1
    assert "nothing to plot" in capsys.readouterr().err
    assert main(["metrics", str(tmp_path), "--last", "0"]) == 2  # raised to the one boundary
    assert capsys.readouterr().err.strip() == "error: --last must be >= 1, got 0"


def test_commands_that_build_a_config_share_one_modifier_and_set_block():
    import importlib

    from axplug.api import add_config_arguments

    parser = argparse.ArgumentParser()
    add_config_arguments(parser)
    args = parser.parse_args(["--modifier", "rope", "--set", "a=1", "--modifier", "mesh"])
    assert (args.modifier, args.overrides) == (["rope", "mesh"], ["a=1"])
    for name in ("axplug.cli.train_cmd", "axplug.cli.import_hf_cmd", "axplug_aot.command",
                 "axplug_launch.command"):  # fmt: skip
        sub = importlib.import_module(name).add_parser(argparse.ArgumentParser().add_subparsers())
        flags = {a.option_strings[0]: (a.dest, a.metavar) for a in sub._actions if a.option_strings}
        assert flags["--modifier"] == ("modifier", "NAME[:k=v,...]"), name
        assert flags["--set"] == ("overrides", "PATH=VALUE"), name
