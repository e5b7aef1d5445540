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
        ("max_steps: 3\nlog_every: 1\nmax_steps: 4\n", ["--preset", "gpt-tiny"],
         "the key 'max_steps' is given twice (lines 1 and 3)"),
        ("learner:\n  b1: 0.9\n  b1: 0.8\n", ["--preset", "gpt-tiny"],
         "the key 'b1' is given twice (lines 2 and 3)"),
        ("a: &x 1\nmax_steps: *x\n", ["--preset", "gpt-tiny"],
         "line 2: a YAML alias (*name); write the value out"),
    ],
)  # fmt: skip
def test_a_bad_overlay_is_one_error_naming_the_file_and_path(tmp_path, capsys, text, args,
                                                              message):  # fmt: skip
    (tmp_path / "e.yaml").write_text(text)
    code = main(["train", *args, "--config", str(tmp_path / "e.yaml"), "--print-config"])
    err = capsys.readouterr().err
    assert code == 2 and message in err
    assert err.count("\nerror:") + err.startswith("error:") == 1, err


def _alias_bomb(levels: int = 9) -> str:
    """1.2 KB of YAML under a real field that expands to 9**levels strings."""
    lines = ["max_steps:", "  - &a0 [lol, lol, lol, lol, lol, lol, lol, lol, lol]"]
    lines += [f"  - &a{i} [{', '.join([f'*a{i - 1}'] * 9)}]" for i in range(1, levels)]
    return "\n".join(lines) + "\n"


def test_an_alias_bomb_is_refused_before_it_expands(tmp_path, capsys):
    bomb = tmp_path / "bomb.yaml"
    bomb.write_text(_alias_bomb())
    assert bomb.stat().st_size < 1500
    assert main(["train", "--preset", "gpt-tiny", "--config", str(bomb), "--print-config"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"error: --config {bomb}: line 3: a YAML alias (*name); write the value out"


def test_a_huge_value_is_shown_in_a_few_hundred_characters():
    from axplug_testing import tiny_trainer_config

    from axplug.config import ConfigTypeError

    bomb: list = ["lol"]
    for _ in range(12):  # 9**12 leaves if printed whole; shared, so built at once
        bomb = [bomb] * 9
    with pytest.raises(ConfigTypeError, match="max_steps: expected int, got list") as caught:
        tiny_trainer_config("run").max_steps = bomb
    assert len(str(caught.value)) < 500


@pytest.mark.parametrize(
    ("name", "data", "message"),
    [
        ("exp.json", b'{"max_steps": 3, "max_steps": 4}', "the key 'max_steps' is given twice"),
        ("exp.yaml", b"max_steps: 3\n\x89PNG\r\n\x1a\n",
         "not UTF-8 text (byte 0x89 at offset 13)"),
        ("exp.toml", b"max_steps = 3\nmax_steps = 4\n", "not TOML"),
    ],
)  # fmt: skip
def test_binary_files_and_repeated_keys_are_one_error_line(tmp_path, capsys, name, data, message):
    (tmp_path / name).write_bytes(data)
    args = ["train", "--preset", "gpt-tiny", "--config", str(tmp_path / name), "--print-config"]
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: --config {tmp_path / name}: ") and message in err, err
    assert "\n" not in err


def test_a_whole_config_with_a_preset_is_refused(tmp_path, capsys):
    from axplug_testing import train_config

    from axplug.trainer.run import write_config

    assert main(["train", "--preset", "gpt-tiny", "--print-config"]) == 0
    capsys.readouterr()
    # The config.json a run writes before it trains.
    write_config(train_config(["--preset", "gpt-tiny", "--output-dir", str(tmp_path / "r")]))
    whole = tmp_path / "r" / "config.json"
    assert main(["train", "--preset", "gpt-tiny", "--config", str(whole), "--print-config"]) == 2
    assert "replaces the preset" in capsys.readouterr().err
    assert main(["train", "--config", str(whole), "--print-config"]) == 0


def test_diff_goes_with_print_config(capsys):
    assert main(["train", "--preset", "gpt-tiny", "--diff", "--output-dir", "x"]) == 2
    assert "--diff goes with --print-config" in capsys.readouterr().err
