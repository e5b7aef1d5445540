"""Goodput: exclusive phase accounting, and a real run's split of its wall time."""

import shutil
import time

import pytest
from axplug_testing import tiny_train_args, tiny_trainer_config

from axplug.cli.main import main
from axplug.runtime import PHASES, GoodputRecorder, format_goodput
from axplug.summary import read_jsonl


def test_phases_are_exclusive_and_add_up_to_the_wall_time():
    rec = GoodputRecorder()
    time.sleep(0.02)  # setup
    rec.switch("other")
    with rec.phase("checkpoint"):
        time.sleep(0.05)
        with rec.phase("step"):  # pauses the checkpoint clock
            time.sleep(0.05)
    time.sleep(0.02)
    report = rec.report()
    parts = [report[f"goodput/{p}_s"] for p in PHASES]
    assert all(p >= 0 for p in parts)
    assert sum(parts) == pytest.approx(report["goodput/wall_s"], abs=1e-4)
    assert report["goodput/setup_s"] == pytest.approx(0.02, abs=0.015)
    assert report["goodput/checkpoint_s"] == pytest.approx(0.05, abs=0.015)
    assert report["goodput/step_s"] == pytest.approx(0.05, abs=0.015)
    assert report["goodput/other_s"] == pytest.approx(0.02, abs=0.015)
    assert report["goodput/fraction"] == pytest.approx(
        report["goodput/step_s"] / report["goodput/wall_s"], rel=1e-3
    )


def test_unknown_phase_is_an_error_naming_the_phases():
    rec = GoodputRecorder()
    with pytest.raises(ValueError, match="unknown goodput phase 'io'; phases: setup, init"):
        rec.switch("io")


def test_format_lists_every_phase():
    report = GoodputRecorder().report()
    text = format_goodput(report)
    assert text.startswith("goodput ")
    assert [line.split()[0] for line in text.splitlines()[1:]] == list(PHASES)


TINY = [
    "checkpoint_every=3",
    "summary_writers=[]",
    "model.decoder.transformer.num_layers=1",
    "input.seq_len=16",
]


def check_parts(report, wall):
    parts = {p: report[f"goodput/{p}_s"] for p in PHASES}
    assert all(v >= 0 for v in parts.values()), parts
    assert sum(parts.values()) == pytest.approx(report["goodput/wall_s"], abs=1e-3)
    # The recorder covers the whole run: from building the trainer to the last save.
    assert report["goodput/wall_s"] == pytest.approx(wall, rel=0.05, abs=0.1)
    return parts


def test_a_run_splits_its_time_and_a_restart_shows_restore_time(tmp_path, capsys):
    run_dir, cache = tmp_path / "run", tmp_path / "xla-cache"
    tiny = [*TINY, f"compilation_cache_dir={str(cache)!r}"]
    cfg = tiny_trainer_config(run_dir, *tiny, max_steps=6)
    start = time.perf_counter()
    metrics = cfg.instantiate().run()
    fresh = check_parts(metrics, time.perf_counter() - start)
    assert fresh["init"] > 0 and fresh["restore"] == 0
    assert fresh["compile"] > 0 and fresh["step"] > 0 and fresh["checkpoint"] > 0
    assert fresh["setup"] > 0 and fresh["data_wait"] > 0

    # As if killed after step 3: the CLI restores it, trains 4..6 and prints the split.
    shutil.rmtree(run_dir / "checkpoints" / "step_00000006")
    assert main(tiny_train_args(run_dir, *tiny, max_steps=6)) == 0
    out = capsys.readouterr().out
    assert "done: step 6" in out and "goodput " in out
    restore_line = next(line for line in out.splitlines() if line.split()[:1] == ["restore"])
    assert float(restore_line.split()[1]) > 0

    runs = read_jsonl(run_dir / "goodput.jsonl")
    assert [r["step"] for r in runs] == [6, 6]
    assert runs[0]["goodput/wall_s"] == metrics["goodput/wall_s"]
    assert runs[1]["goodput/restore_s"] > 0 and runs[1]["goodput/init_s"] == 0
    assert runs[1]["goodput/step_s"] > 0 and runs[1]["goodput/slow_steps"] >= 0
    # The second attempt recomputed steps 4..6, which the first had done: lost steps.
    assert (runs[1]["attempt"], runs[1]["start_step"], runs[1]["lost_steps"]) == (2, 3, 3)
    assert runs[1]["job/steps_computed"] == 9 and runs[1]["job/productive_steps"] == 6


def test_a_killed_attempts_progress_lagging_its_checkpoint_counts_the_checkpointed_steps(
    tmp_path,
):
    from axplug.checkpoint.storage import LocalStorage
    from axplug.trainer.attempts import AttemptRecorder

    storage, url, summary = LocalStorage(), str(tmp_path / "goodput.jsonl"), str(tmp_path)
    first = AttemptRecorder(storage, url, summary, start_step=0, started=time.time())
    first.step_completed(1, step_s=0.1)  # progress.json says step 1, then at most a second
    # passes before its next write: the attempt saves step 2 and is killed in that window.
    second = AttemptRecorder(storage, url, summary, start_step=2, started=time.time())
    killed = second.records[-1]
    assert (killed["end"], killed["step"], killed["steps"]) == ("killed", 2, 2)
    assert second.lost_steps == 0
    fields = second.finish(8, "done", {"goodput/step_s": 0.6, "goodput/wall_s": 1.0})
    assert fields["job/productive_steps"] == 8 and fields["job/steps_computed"] == 8
