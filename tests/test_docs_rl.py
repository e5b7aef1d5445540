"""docs/rl.md, followed as written: a GRPO run on rollouts from the trainer's own Engine that
learns its toy task, then generates from the result."""

import json

import pytest

from axplug.cli import main
from axplug.summary import read_jsonl
from doc_pages import shell_commands


def test_the_page_runs_as_written(tmp_path, monkeypatch, capsys):
    pytest.importorskip("axplug_rl")
    rows = [{"prompt": f"echo {d}", "answer": str(d)} for d in range(10)]
    (tmp_path / "echo.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows * 20))
    (tmp_path / "echo-eval.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    monkeypatch.chdir(tmp_path)
    steps = shell_commands("rl.md")
    assert [argv[1] for argv in steps] == ["train", "generate"]
    for argv in steps:
        assert main(argv[1:]) == 0, argv
    records = read_jsonl(tmp_path / "runs" / "echo" / "metrics.jsonl")
    passes = [r["eval/pass@1"] for r in records if "eval/pass@1" in r]
    rewards = [r["reward/mean"] for r in records if "reward/mean" in r]
    assert passes[0] == 0.0 and passes[-1] >= 0.2, passes
    assert sum(rewards[-5:]) / 5 > sum(rewards[:3]) / 3 + 0.1, rewards
    assert "echo 4" in capsys.readouterr().out
