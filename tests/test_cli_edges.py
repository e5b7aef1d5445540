"""Issue 32's edges of the CLI: a full disk as one line, recipe presets, partial saves in
`checkpoints ls`, `checkpoints rm` of the latest step, `--print-config` refusing what the run
refuses, a blocked save that says so, and no credentials in a run's files."""

import errno
import json
import logging
import os
import pathlib
import threading
import time

import numpy as np
import pytest
from axplug_testing import tiny_train_args

from axplug.cli import main


def one_error_line(err: str) -> str:
    """The only line of `err`, which must be an `error:` line (no traceback, no echo)."""
    lines = [line for line in err.splitlines() if line.strip()]
    lines = [line for line in lines if line != "mesh rule: cpu"]
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    return lines[0]


def expected_mount(path: pathlib.Path) -> str:
    current = path
    while not current.exists():
        current = current.parent
    current = pathlib.Path(os.path.realpath(current))
    while not os.path.ismount(current):
        current = current.parent
    return str(current)


# -- 1. a full disk -------------------------------------------------------------------------


def test_a_full_disk_is_one_line_naming_the_device_and_the_file(tmp_path, monkeypatch, capsys):
    written, failed = [], []
    real_write_text = pathlib.Path.write_text

    def fills_up(self, *args, **kwargs):  # the third file finds the disk full
        if len(written) == 2:
            failed.append(self)
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(self))
        written.append(self)
        return real_write_text(self, *args, **kwargs)

    monkeypatch.setattr(pathlib.Path, "write_text", fills_up)
    out = tmp_path / "new" / "plugins"
    assert main(["new-plugin", "axplug-full", "--dir", str(out)]) == 1
    line = one_error_line(capsys.readouterr().err)
    assert line.startswith("error: no space left on ")
    assert f"(mounted at {expected_mount(out)}) writing {failed[0]}: free space there" in line
    assert not (tmp_path / "new").exists(), "a failed new-plugin leaves nothing behind"


def test_a_full_disk_without_a_file_name_still_says_so(capsys):
    from axplug.cli.main import run_reporting_errors

    def write():
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    assert run_reporting_errors(write) == 1
    assert one_error_line(capsys.readouterr().err).startswith(
        "error: no space left on device (No space left on device)"
    )


def test_a_full_disk_during_a_copy_names_the_destination(tmp_path, capsys):
    from axplug.cli.main import run_reporting_errors

    def copy():
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), "/src/big.bin", None, "/dst/big.bin")

    assert run_reporting_errors(copy) == 1
    line = one_error_line(capsys.readouterr().err)
    assert "writing /dst/big.bin: " in line and "/src/" not in line


def test_the_mount_of_a_path_not_made_yet_is_its_nearest_parents(tmp_path):
    from axplug.cli._no_space import mount_of

    mount, device = mount_of(str(tmp_path / "a" / "b" / "c.bin"))
    assert mount == expected_mount(tmp_path)
    assert device is None or device  # /proc/self/mounts names it on Linux


# -- 3. recipe presets ----------------------------------------------------------------------


def test_a_preset_that_is_no_recipe_is_refused_naming_it(tmp_path, capsys):
    run = tmp_path / "run"
    assert main(["train", "--preset", "os:system", "--output-dir", str(run)]) == 2
    line = one_error_line(capsys.readouterr().err)
    assert "--preset 'os:system' takes arguments (command)" in line
    assert "function of no arguments" in line
    assert not run.exists()
    assert main(["train", "--preset", "os:sep", "--print-config"]) == 2
    assert "--preset 'os:sep' is a str" in one_error_line(capsys.readouterr().err)


def test_a_recipe_module_not_importable_says_pythonpath(capsys):
    assert main(["train", "--preset", "no_such_recipes:small", "--print-config"]) == 2
    line = one_error_line(capsys.readouterr().err)
    assert "no module named 'no_such_recipes'" in line and "PYTHONPATH" in line
    assert "--preset path/to/no_such_recipes.py:small" in line


def test_a_recipe_file_path_is_loaded(tmp_path, capsys):
    recipes = tmp_path / "my recipes"
    recipes.mkdir()
    (recipes / "small.py").write_text(
        "from axplug.presets import preset_config\n"
        "def build():\n"
        "    cfg = preset_config('gpt-tiny')\n"
        "    cfg.model.decoder.dim = 48\n"
        "    return cfg\n"
    )
    spec = f"{recipes / 'small.py'}:build"
    assert main(["train", "--preset", spec, "--print-config"]) == 0
    assert "model.decoder.dim: 48" in capsys.readouterr().out
    (recipes / "broken.py").write_text("def build(:\n")
    assert main(["train", "--preset", f"{recipes / 'broken.py'}:build", "--print-config"]) == 2
    line = one_error_line(capsys.readouterr().err)
    assert f"{recipes / 'broken.py'}, line 1" in line
    assert main(["train", "--preset", f"{recipes / 'small.py'}:nope", "--print-config"]) == 2
    assert "has no 'nope'" in one_error_line(capsys.readouterr().err)
    assert main(["train", "--preset", f"{tmp_path / 'none.py'}:build", "--print-config"]) == 2
    assert "none.py is not a file" in one_error_line(capsys.readouterr().err)


# -- 4. checkpoints ls / rm -----------------------------------------------------------------


def _saved(directory: pathlib.Path, *steps: int) -> None:
    from axplug.checkpoint import Checkpointer

    cfg = Checkpointer.default_config().set(directory=str(directory), async_save=False)
    with cfg.instantiate() as checkpointer:
        for step in steps:
            checkpointer.save(step, {"w": np.arange(4.0, dtype=np.float32) + step})


def _partial(directory: pathlib.Path, step: int, *, marker: bool = False) -> pathlib.Path:
    """What orbax leaves of a save killed before its rename: the step's temporary dir."""
    import shutil

    from axplug.checkpoint.layout import COMMIT_MARKER, step_dir_name

    scratch = directory.parent / "scratch"
    _saved(scratch, step)
    leftover = directory / f"{step_dir_name(step)}.orbax-checkpoint-tmp"  # orbax 0.12's name
    directory.mkdir(parents=True, exist_ok=True)
    shutil.move(scratch / step_dir_name(step), leftover)
    shutil.rmtree(scratch)
    if not marker:
        (leftover / COMMIT_MARKER).unlink()
    return leftover


def _rows(out: str) -> list[tuple[int, str]]:
    return [(int(r.split()[0]), r.split()[1]) for r in out.splitlines()[2:]]


def test_ls_lists_a_partial_save_as_partial(tmp_path, capsys):
    run = tmp_path / "run"
    _partial(run / "checkpoints", 3)
    assert main(["checkpoints", "ls", str(run)]) == 0
    out = capsys.readouterr().out
    assert _rows(out) == [(3, "partial")], out
    # Killed between writing the marker and the rename: still partial, never restored.
    _saved(run / "checkpoints", 1)
    _partial(run / "checkpoints", 5, marker=True)
    assert main(["checkpoints", "ls", str(run), "--json"]) == 0
    records = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [(r["step"], r["state"], r["complete"]) for r in records] == [
        (1, "complete", True),
        (3, "partial", False),
        (5, "partial", False),
    ]
    from axplug.checkpoint import Checkpointer

    cfg = Checkpointer.default_config().set(directory=str(run / "checkpoints"))
    with cfg.instantiate() as checkpointer:
        assert checkpointer.all_steps() == [1]


def test_rm_refuses_the_only_or_latest_complete_step_without_force(tmp_path, capsys):
    directory = tmp_path / "run" / "checkpoints"
    _saved(directory, 2)
    step2 = directory / "step_00000002"
    assert main(["checkpoints", "rm", str(tmp_path / "run"), "--step", "2"]) == 2
    line = one_error_line(capsys.readouterr().err)
    assert "step 2 is the only complete checkpoint" in line and "--force" in line
    assert (step2 / "commit_success.txt").exists()

    _saved(directory, 4)
    assert main(["checkpoints", "rm", str(directory), "--step", "4"]) == 2
    line = one_error_line(capsys.readouterr().err)
    assert "step 4 is the latest complete checkpoint" in line and "back to step 2" in line
    assert main(["checkpoints", "rm", str(directory), "--step", "2"]) == 0  # not the latest
    assert "deleted step 2" in capsys.readouterr().out and not step2.exists()
    assert main(["checkpoints", "rm", str(directory), "--step", "4", "--force"]) == 0
    assert not (directory / "step_00000004").exists()

    leftover = _partial(directory, 6)  # a partial save is no complete step: no --force
    assert main(["checkpoints", "rm", str(directory), "--step", "6"]) == 0
    assert not leftover.exists()
    assert main(["checkpoints", "rm", str(directory), "--step", "6"]) == 1
    assert "step 6 does not exist" in one_error_line(capsys.readouterr().err)


# -- 5. --print-config refuses what the run refuses ----------------------------------------


def test_print_config_refuses_an_unknown_optimizer_with_the_runs_line(tmp_path, capsys):
    bad = ["--set", "learner.optimizer=adamx"]
    assert main(["train", "--preset", "gpt-tiny", "--print-config", *bad]) == 2
    captured = capsys.readouterr()
    printed = one_error_line(captured.err)
    assert captured.out == ""
    assert printed.startswith(
        "error: learner.optimizer: unknown 'adamx' (did you mean 'adam' or 'adamw'?); choose from "
    )
    run = tmp_path / "run"
    assert main([*tiny_train_args(run), "--mesh-rule", "none", *bad]) == 2
    assert one_error_line(capsys.readouterr().err) == printed
    assert not run.exists()


def test_train_refuses_a_bad_choice_before_writing_anything(tmp_path):
    from axplug_testing import tiny_trainer_config

    from axplug.config import ConfigError
    from axplug.trainer.run import train

    cfg = tiny_trainer_config(tmp_path / "run", "saving.on_error='retry_later'")
    with pytest.raises(ConfigError, match="saving.on_error: must be one of"):
        train(cfg)
    assert not (tmp_path / "run").exists()


# -- 6. a blocked save says what it waits on ------------------------------------------------


class _Records(logging.Handler):
    def __init__(self):
        super().__init__()
        self.records: list[logging.LogRecord] = []
        self.logged = threading.Event()

    def emit(self, record):
        self.records.append(record)
        self.logged.set()


def test_a_save_blocked_past_the_threshold_logs_once_what_it_waits_on(tmp_path, monkeypatch):
    import orbax.checkpoint as ocp

    from axplug.checkpoint import Checkpointer, _slow_save

    handler = _Records()
    logger = logging.getLogger("axplug.checkpoint")
    logger.addHandler(handler)
    monkeypatch.setattr(_slow_save, "SLOW_SAVE_WARNING_S", 0.05)
    real_wait = ocp.AsyncCheckpointer.wait_until_finished

    def frozen_store(self):  # blocks until the warning is out (at most 30 s), then commits
        handler.logged.wait(30)
        time.sleep(0.2)  # blocked longer still: the warning is not repeated
        return real_wait(self)

    directory = tmp_path / "ckpt"
    try:
        with Checkpointer.default_config().set(directory=str(directory)).instantiate() as ckpt:
            ckpt.save(7, {"w": np.ones(4, np.float32)})
            monkeypatch.setattr(ocp.AsyncCheckpointer, "wait_until_finished", frozen_store)
            ckpt.wait_until_finished()
            monkeypatch.setattr(ocp.AsyncCheckpointer, "wait_until_finished", real_wait)
            assert ckpt.all_steps() == [7]
            monkeypatch.setattr(_slow_save, "SLOW_SAVE_WARNING_S", 30.0)
            ckpt.save(8, {"w": np.ones(4, np.float32)})  # a quick save says nothing
    finally:
        logger.removeHandler(handler)
    assert [r.levelno for r in handler.records] == [logging.WARNING]
    message = handler.records[0].getMessage()
    assert message.startswith(f"waiting for the save of step 7 to {directory}/step_00000007: ")
    assert "still writing after 0 s" in message


# -- no credentials in the files a run writes -----------------------------------------------


def test_uris_lose_their_user_info_in_config_txt_and_config_json(tmp_path):
    from axplug_testing import tiny_trainer_config

    from axplug.config import strip_userinfo
    from axplug.trainer.run import write_config

    assert strip_userinfo("s3://k:secret@bucket/a@b") == "s3://bucket/a@b"
    assert strip_userinfo("x https://tok@h:1/p?u=a@b 'gs://b/x@y'") == (
        "x https://h:1/p?u=a@b 'gs://b/x@y'"
    )
    cfg = tiny_trainer_config(tmp_path / "run", "restore.init_from='https://bob:hunter2@host/run'")
    write_config(cfg, {"argv": ["--set", "restore.init_from=https://bob:hunter2@host/run"]})
    for name in ("config.txt", "config.json"):
        text = (tmp_path / "run" / name).read_text()
        assert "https://host/run" in text and "hunter2" not in text and "bob" not in text
