"""The TensorBoard writer does not pay for importing torch, and leaves torch importable."""

import importlib.util
import subprocess
import sys

import pytest

pytest.importorskip("axplug_tensorboard")

CODE = """
import sys
from axplug_tensorboard import TensorBoardWriter
w = TensorBoardWriter.default_config().set(dir=sys.argv[1]).instantiate()
w.write(1, {"loss": 1.5})
w.close()
print("torch imported:", "torch" in sys.modules)
if sys.argv[2] == "yes":
    import torch  # still importable after the writer hid it
    print("torch after:", torch.__name__)
"""


def test_the_writer_imports_no_torch_and_writes_events(tmp_path):
    has_torch = importlib.util.find_spec("torch") is not None
    run = subprocess.run([sys.executable, "-c", CODE, str(tmp_path), "yes" if has_torch else "no"],
                         capture_output=True, text=True, timeout=300)  # fmt: skip
    assert run.returncode == 0, run.stderr[-2000:]
    assert "torch imported: False" in run.stdout
    if has_torch:
        assert "torch after: torch" in run.stdout
    assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
