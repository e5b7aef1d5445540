"""docs/configs.md as written, and config overlays through `axplug train`."""

import json
import re

import pytest

from axplug.cli import main
from doc_pages import DOCS, shell_commands


def _yaml_block() -> str:
    return re.search(r"```yaml\n(.*?)```", (DOCS / "configs.md").read_text(), re.S).group(1)


def test_the_page_runs_as_written(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "exp.yaml").write_text(_yaml_block())
    steps = shell_commands("configs.md")
    assert [argv[:2] for argv in steps] == [["axplug", "train"]] * 2
    assert main(steps[0][1:]) == 0
    diff = capsys.readouterr().out.splitlines()
    assert "learner.learning_rate: 0.003 -> 0.001" in diff
    assert "model.decoder.dim: 128 -> 32" in diff and "max_steps: 100 -> 4" in diff
    assert all(" -> " in line for line in diff) and len(diff) <= 6
    assert main(steps[1][1:]) == 0
    config = (tmp_path / "runs/exp/config.txt").read_text()
    assert "learner.learning_rate: 0.001" in config and "model.decoder.dim: 32" in config
    rows = [json.loads(line) for line in (tmp_path / "runs/exp/metrics.jsonl").open()]
    assert max(r["step"] for r in rows) == 4


def _print(tmp_path, name, text, *args):
    (tmp_path / name).write_text(text)
    return main(["train", "--config", str(tmp_path / name), "--print-config", *args])


@pytest.mark.parametrize(
    ("name", "text"),
    [
        ("e.toml", 'preset = "gpt-tiny"\n[learner]\nlearning_rate = 0.001\n'),
        ("e.json", '{"preset": "gpt-tiny", "learner": {"learning_rate": 0.001}}'),
        ("e.yml", "preset: gpt-tiny\nlearner.learning_rate: 0.001\n"),
    ],
)
def test_toml_json_and_yaml_overlays_set_the_same_field(tmp_path, capsys, name, text):
    assert _print(tmp_path, name, text) == 0
    assert "learner.learning_rate: 0.001" in capsys.readouterr().out.splitlines()


def test_modifiers_and_input_keys_and_flags_win_over_the_file(tmp_path, capsys):
    text = ("preset: llama-tiny\nmodifiers: ['gqa:num_kv_heads=2']\n"
            "input: synthetic:vocab_size=256\nmax_steps: 50\n")  # fmt: skip
    assert _print(tmp_path, "e.yaml", text, "--diff", "--max-steps", "7") == 0
    out = capsys.readouterr().out
    assert "max_steps: 300 -> 7" in out  # the flag, not the file's 50
    assert "input.klass: axplug.input.text:ByteTextInput -> axplug.input.synthetic:" in out
    assert "num_kv_heads" in out


@pytest.mark.parametrize(
    ("text", "args", "message"),
    [
        ("learner:\n  lerning_rate: 1\n", ["--preset", "gpt-tiny"],
         "learner.lerning_rate: unknown field, did you mean 'learning_rate'?"),
        ("learner:\n  learning_rate: fast\n", ["--preset", "gpt-tiny"],
         "learner.learning_rate: expected float, got str ('fast')"),
        ("learner:\n  b1: 0.9\n", [], "a partial config needs a base"),
        ("model:\n  klass: os:system\n", ["--preset", "gpt-tiny"], "os:system"),
        ("- a list\n", ["--preset", "gpt-tiny"], "not a mapping of fields"),
        ("learner: [\n", ["--preset", "gpt-tiny"], "not YAML"),
    ],
)  # fmt: skip
def test_a_bad_overlay_is_one_error_naming_the_file_and_path(tmp_path, capsys, text, args,
                                                              message):  # fmt: skip
    (tmp_path / "e.yaml").write_text(text)
    code = main(["train", *args, "--config", str(tmp_path / "e.yaml"), "--print-config"])
    err = capsys.readouterr().err
    assert code == 2 and message in err
    assert err.count("\nerror:") + err.startswith("error:") == 1, err


def test_a_whole_config_with_a_preset_is_refused(tmp_path, capsys):
    assert main(["train", "--preset", "gpt-tiny", "--print-config"]) == 0
    capsys.readouterr()
    main(["train", "--preset", "gpt-tiny", "--modifier", "mesh", "--output-dir",
          str(tmp_path / "r"), "--max-steps", "1", "--set", "model.decoder.dim=32"])  # fmt: skip
    whole = tmp_path / "r" / "config.json"
    assert main(["train", "--preset", "gpt-tiny", "--config", str(whole), "--print-config"]) == 2
    assert "replaces the preset" in capsys.readouterr().err
    assert main(["train", "--config", str(whole), "--print-config"]) == 0


def test_diff_goes_with_print_config(capsys):
    assert main(["train", "--preset", "gpt-tiny", "--diff", "--output-dir", "x"]) == 2
    assert "--diff goes with --print-config" in capsys.readouterr().err
