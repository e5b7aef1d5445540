"""docs/scaling.md, followed as written: its shell blocks run in order in a fresh directory."""

import jax
import pytest

from axplug.cli import main
from axplug.summary import read_jsonl
from doc_pages import shell_commands


@pytest.mark.slow
def test_the_page_runs_as_written(tmp_path, monkeypatch, capsys):
    assert len(jax.devices()) == 8  # the page's fake devices (conftest)
    monkeypatch.chdir(tmp_path)
    steps = shell_commands("scaling.md")
    assert [argv[:2] for argv in steps] == [
        ["axplug", "train"],
        ["axplug", "aot"],
        ["axplug", "train"],
        ["axplug", "train"],
    ]
    for argv in steps:
        assert main(argv[1:]) == 0, argv
    out = capsys.readouterr().out
    assert "pipeline: 4 stages x 2 virtual x 8 microbatches (circular), bubble 15.8%" in out
    for run in ("pp", "int8", "fp8-ffn"):
        records = [r for r in read_jsonl(tmp_path / "runs" / run / "metrics.jsonl") if "loss" in r]
        assert records[-1]["step"] == 10 and records[-1]["loss"] < 5.0, (run, records[-1])
