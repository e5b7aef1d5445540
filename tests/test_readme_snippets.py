"""The README's code runs as printed."""

import math
import re
import runpy
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def _python_block(after_heading: str) -> str:
    text = README.read_text()
    section = text[text.index(after_heading) :]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_a_model_is_a_config_runs_as_printed(tmp_path, capsys):
    script = tmp_path / "snippet.py"
    script.write_text(_python_block("## A model is a config"))
    runpy.run_path(str(script), run_name="__main__")  # as `python snippet.py`, in this process
    lines = capsys.readouterr().out.splitlines()
    assert "decoder.transformer.num_layers: 2" in lines
    assert "decoder.transformer.layer.feed_forward.hidden_dim: 128" in lines
    loss = float(lines[-1])
    assert math.isfinite(loss) and 0 < loss < 2 * math.log(256)


def test_the_aot_planning_line_runs_on_cpu(capfd):
    """The README's `axplug aot` line for a TPU slice compiles on fake CPU devices."""
    import shlex

    from axplug.cli import main

    text = README.read_text().replace("\\\n", " ")
    line = next(x for x in text.splitlines() if x.startswith("axplug aot --preset llama2-7b"))
    argv = shlex.split(line.split("#")[0])
    assert main(argv[1:]) == 0
    out = capfd.readouterr().out  # from a child process when jax is already initialized here
    assert "llama2-7b on tpu-v5e" in out and "256 devices" in out and "fits" in out
