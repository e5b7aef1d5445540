"""`import-hf` and `export-hf` at their edges: cut short (SIGKILL, a full disk) they leave
nothing that looks complete and run again as they are; a bad input (an integer or NaN weight,
a garbage tokenizer, an occupied --output) is one `error:` line before anything is written."""

import errno
import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest
from safetensors.numpy import load_file

from axplug.cli import main
from test_hf_import import (
    ONE_DEVICE,
    hf_weights,
    llama_config,
    load_run,
    word_tokenizer,
    write_hf,
)

# `python STALL MARKER ARGS...`: `axplug ARGS` whose copy of tokenizer.json (import) or first
# safetensors shard (export) writes part of the file, creates MARKER and hangs there, for the
# test to SIGKILL it mid-write.
STALL = """\
import shutil, sys, time
import safetensors.numpy

marker = sys.argv[1]
copy, save = shutil.copyfileobj, safetensors.numpy.save_file

def hang():
    open(marker, "w").close()
    time.sleep(600)

def stalled_copy(src, dst, length=0):
    if not getattr(src, "name", "").endswith("tokenizer.json"):
        return copy(src, dst, length)
    dst.write(src.read(100))
    dst.flush()
    hang()

def stalled_save(tensors, path, metadata=None):
    with open(path, "wb") as f:
        f.write(b"partial")
    hang()

shutil.copyfileobj, safetensors.numpy.save_file = stalled_copy, stalled_save
from axplug.cli import main
sys.exit(main(sys.argv[2:]))
"""


# Imports on one device: the edges here are the same on any mesh, and a tiny import laid out
# over the session's 8 fake devices costs about twice as much (test_hf_import's first test
# imports over all of them).
ON_ONE_DEVICE = ("--set", *ONE_DEVICE)


@pytest.fixture
def hf_dir(tmp_path):
    """A tiny LLaMA in Hugging Face format, with a word-level tokenizer.json."""
    cfg = llama_config()
    src = write_hf(tmp_path / "hf", cfg, hf_weights(cfg))
    word_tokenizer(tmp_path / "hf", cfg["vocab_size"])
    return src


def error_line(capsys) -> str:
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def complete_steps(run_dir, capsys) -> list[int]:
    """The complete steps `axplug checkpoints ls --json` lists under `run_dir`."""
    capsys.readouterr()
    main(["checkpoints", "ls", str(run_dir), "--json"])
    records = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    return [r["step"] for r in records if r["complete"]]


def run_files(run_dir) -> dict[str, bytes]:
    """The files of an import beside its checkpoint, their own path written as OUT."""
    run_dir = pathlib.Path(run_dir)
    out = {}
    for path in sorted(run_dir.iterdir()):
        if path.is_file():
            text = path.read_bytes().replace(str(run_dir).encode(), b"OUT")
            if path.name == "config.json":  # provenance holds the time it was written
                text = json.dumps(json.loads(text)["config"]).encode()
            out[path.name] = text
    return out


def assert_same_import(run_dir, clean_dir):
    assert run_files(run_dir) == run_files(clean_dir)
    _, step, state, _ = load_run(run_dir)
    _, clean_step, clean_state, _ = load_run(clean_dir)
    assert step == clean_step == 0
    jax.tree.map(np.testing.assert_array_equal, state["params"], clean_state["params"])


def stall_and_kill(tmp_path, *args) -> None:
    """Runs `axplug ARGS` under STALL and SIGKILLs it once it hangs mid-write."""
    wrapper, marker = tmp_path / "stall.py", tmp_path / "stalled"
    wrapper.write_text(STALL)
    with open(tmp_path / "stall.log", "w+") as log:
        proc = subprocess.Popen(
            [sys.executable, str(wrapper), str(marker), *map(str, args)],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + 120
        while not marker.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=60)
        log.seek(0)
        assert marker.exists() and proc.returncode == -signal.SIGKILL, log.read()[-3000:]


# --- 1. import-hf cut short while copying the tokenizer ----------------------------------------


def test_an_import_killed_mid_tokenizer_copy_has_no_complete_step_and_reruns(
    hf_dir, tmp_path, capsys
):
    out = tmp_path / "run"
    stall_and_kill(tmp_path, "import-hf", hf_dir, "--output", out, *ON_ONE_DEVICE)
    assert complete_steps(out, capsys) == []
    assert not (out / "tokenizer.json").exists()  # only a temporary name holds the partial copy
    assert main(["import-hf", hf_dir, "--output", str(out), *ON_ONE_DEVICE]) == 0
    assert main(["import-hf", hf_dir, "--output", str(tmp_path / "clean"), *ON_ONE_DEVICE]) == 0
    assert complete_steps(out, capsys) == [0]
    assert_same_import(out, tmp_path / "clean")
    assert not [p for p in os.listdir(out) if p.startswith(".")]  # the killed copy is gone


def test_a_full_disk_during_the_tokenizer_copy_leaves_no_complete_step(
    hf_dir, tmp_path, capsys, monkeypatch
):
    import shutil

    copy = shutil.copyfileobj

    def full(src, dst, length=0):
        dst.write(src.read(100))
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))  # as a write names no file

    out = tmp_path / "run"
    monkeypatch.setattr(shutil, "copyfileobj", full)
    assert main(["import-hf", hf_dir, "--output", str(out), *ON_ONE_DEVICE]) == 1
    line = error_line(capsys)
    assert "no space left" in line.lower() and str(out / "tokenizer.json") in line
    assert complete_steps(out, capsys) == []
    assert not out.exists() or not [p for p in os.listdir(out) if p.startswith(".")]
    monkeypatch.setattr(shutil, "copyfileobj", copy)
    assert main(["import-hf", hf_dir, "--output", str(out), *ON_ONE_DEVICE]) == 0
    assert complete_steps(out, capsys) == [0]


def test_a_full_disk_writing_config_txt_names_it_and_leaves_no_complete_step(
    hf_dir, tmp_path, capsys, monkeypatch
):
    from axplug import files

    class Full:
        """config.txt opened for writing on a full disk: its writes fail, naming no file."""

        def __init__(self, file):
            self.file = file

        def __enter__(self):
            return self

        def write(self, text):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

        def __exit__(self, *exc):
            self.file.close()

    def full_open(path, mode="r", *args, **kwargs):
        file = open(path, mode, *args, **kwargs)  # noqa: SIM115 - the caller closes it
        return Full(file) if "w" in mode and "config.txt" in str(path) else file

    out = tmp_path / "run"
    monkeypatch.setattr(files, "open", full_open, raising=False)
    assert main(["import-hf", hf_dir, "--output", str(out), *ON_ONE_DEVICE]) == 1
    line = error_line(capsys)
    assert "no space left" in line.lower() and str(out / "config.txt") in line
    assert complete_steps(out, capsys) == []
    assert not [p for p in os.listdir(out) if p.startswith(".")]


# --- 3. weights that are not float, or not finite --------------------------------------------


@pytest.mark.parametrize("dtype, shown", [(np.int32, "I32"), (np.int8, "I8"), (bool, "BOOL")])
def test_integer_and_bool_weights_are_refused_naming_tensor_file_and_dtype(
    tmp_path, capsys, dtype, shown
):
    cfg = llama_config()
    weights = hf_weights(cfg)
    name = "model.layers.1.mlp.up_proj.weight"
    weights[name] = (weights[name] * 50).astype(dtype)
    src = write_hf(tmp_path / "hf", cfg, weights)
    out = tmp_path / "run"
    assert main(["import-hf", src, "--output", str(out)]) == 2
    line = error_line(capsys)
    assert name in line and f"{src}/model.safetensors" in line and f"dtype {shown}" in line
    assert not out.exists()


@pytest.mark.parametrize("value", [np.nan, np.inf])
def test_non_finite_weights_are_refused_before_anything_is_written(tmp_path, capsys, value):
    cfg = llama_config()
    weights = hf_weights(cfg)
    name = "model.layers.0.self_attn.k_proj.weight"
    weights[name][3, 5] = value
    src = write_hf(tmp_path / "hf", cfg, weights)
    out = tmp_path / "run"
    assert main(["import-hf", src, "--output", str(out)]) == 2
    line = error_line(capsys)
    assert name in line and "NaN or inf" in line and "model.safetensors" in line
    assert not out.exists()  # no config.txt, no config.json


def test_a_weight_beyond_the_parameter_dtype_is_refused_before_anything_is_written(
    tmp_path, capsys
):
    cfg = llama_config()
    weights = {k: v.astype(np.float64) for k, v in hf_weights(cfg).items()}
    weights["model.norm.weight"][0] = 1e300  # finite in float64, inf in float32
    src = write_hf(tmp_path / "hf", cfg, weights)
    out = tmp_path / "run"
    assert main(["import-hf", src, "--output", str(out)]) == 2
    line = error_line(capsys)
    assert "model.norm.weight" in line and "float32" in line
    assert not out.exists()


# --- 4. a garbage tokenizer ------------------------------------------------------------------


@pytest.mark.parametrize(
    "file, text",
    [
        ("tokenizer.json", '{"version": "1.0", "model": {"type": "Wor'),  # cut short
        ("tokenizer.json", '{"version": "1.0", "no": "model"}'),  # JSON, not a tokenizer
        ("tokenizer_config.json", "{'eos_token': '</s>'}"),
    ],
)
def test_a_garbage_tokenizer_file_is_refused_naming_it_before_anything_is_written(
    hf_dir, tmp_path, capsys, file, text
):
    pathlib.Path(hf_dir, file).write_text(text)
    out = tmp_path / "run"
    assert main(["import-hf", hf_dir, "--output", str(out)]) == 2
    assert f"{hf_dir}/{file}" in error_line(capsys)
    assert not out.exists()


def test_generate_on_an_import_whose_tokenizer_was_damaged_is_one_error_line(
    hf_dir, tmp_path, capsys
):
    out = tmp_path / "run"
    assert main(["import-hf", hf_dir, "--output", str(out), *ON_ONE_DEVICE]) == 0
    tokenizer = out / "tokenizer.json"
    tokenizer.write_bytes(tokenizer.read_bytes()[:200])
    capsys.readouterr()
    argv = ["generate", "--checkpoint", str(out), "--prompt", "to be", "--max-new-tokens", "2"]
    assert main(argv) == 2
    assert str(tokenizer) in error_line(capsys)


# --- 2. export-hf: an occupied --output, --force, a kill, a full disk ------------------------


@pytest.fixture
def imported(hf_dir, tmp_path, capsys):
    run = tmp_path / "run"
    assert main(["import-hf", hf_dir, "--output", str(run), *ON_ONE_DEVICE]) == 0
    capsys.readouterr()
    return run


def export_files(directory) -> dict:
    """{file name: its tensors (safetensors) or bytes} of an export."""
    out = {}
    for path in sorted(pathlib.Path(directory).iterdir()):
        out[path.name] = load_file(path) if path.suffix == ".safetensors" else path.read_bytes()
    return out


def assert_same_export(directory, clean):
    got, want = export_files(directory), export_files(clean)
    assert sorted(got) == sorted(want)
    for name, value in want.items():
        if isinstance(value, dict):
            assert sorted(got[name]) == sorted(value)
            for tensor in value:
                np.testing.assert_array_equal(got[name][tensor], value[tensor])
        else:
            assert got[name] == value, name


def siblings(directory) -> list[str]:
    """Temporary directories an export left beside `directory`."""
    directory = pathlib.Path(directory)
    return [p.name for p in directory.parent.iterdir() if p.name.startswith(f".{directory.name}.")]


def test_an_older_export_is_refused_and_force_replaces_the_whole_directory(
    imported, tmp_path, capsys
):
    from axplug.interop.hf_export import export_hf

    out = tmp_path / "out"
    export_hf(str(imported), str(out), shard_bytes=20_000)  # an older, sharded export
    old = export_files(out)
    assert "model.safetensors.index.json" in old
    assert main(["export-hf", str(imported), "--output", str(out)]) == 2
    line = error_line(capsys)
    assert str(out) in line and "--force" in line
    assert export_files(out).keys() == old.keys()  # untouched
    assert main(["export-hf", str(imported), "--output", str(out), "--force"]) == 0
    assert main(["export-hf", str(imported), "--output", str(tmp_path / "clean")]) == 0
    assert sorted(os.listdir(out)) == [
        "config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"
    ]  # fmt: skip
    assert_same_export(out, tmp_path / "clean")
    assert siblings(out) == []


def test_an_output_that_is_a_file_is_one_error_line(imported, tmp_path, capsys):
    target = tmp_path / "notes.txt"
    target.write_text("keep me")
    assert main(["export-hf", str(imported), "--output", str(target)]) == 2
    assert str(target) in error_line(capsys)
    assert target.read_text() == "keep me"


@pytest.mark.parametrize("where", [".", ".."])
def test_force_never_replaces_the_run_being_exported(imported, capsys, where):
    output = os.path.normpath(imported / where)
    assert main(["export-hf", str(imported), "--output", output, "--force"]) == 2
    assert "holds the run" in error_line(capsys)
    assert complete_steps(imported, capsys) == [0]


def test_an_export_killed_mid_write_leaves_no_output_and_reruns(imported, tmp_path, capsys):
    out = tmp_path / "out"
    stall_and_kill(tmp_path, "export-hf", imported, "--output", out)
    assert not out.exists()
    assert len(siblings(out)) == 1  # the dead export's temporary directory
    assert main(["export-hf", str(imported), "--output", str(out)]) == 0
    assert main(["export-hf", str(imported), "--output", str(tmp_path / "clean")]) == 0
    assert_same_export(out, tmp_path / "clean")
    assert siblings(out) == []


def test_a_full_disk_during_an_export_is_one_line_and_leaves_nothing(
    imported, tmp_path, capsys, monkeypatch
):
    import safetensors.numpy
    from safetensors import SafetensorError

    def full(tensors, path, metadata=None):
        raise SafetensorError("Error while serializing: I/O error: No space left (os error 28)")

    monkeypatch.setattr(safetensors.numpy, "save_file", full)
    out = tmp_path / "out"
    assert main(["export-hf", str(imported), "--output", str(out)]) == 1
    line = error_line(capsys)
    assert "no space left" in line.lower() and ".safetensors" in line
    assert not out.exists() and siblings(out) == []
