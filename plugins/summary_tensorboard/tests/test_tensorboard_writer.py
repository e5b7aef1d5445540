"""axplug-tensorboard against the run's metrics.jsonl: event files read back (raw records and
TensorBoard's own reader), scalars, histograms, resumed runs and `--writer tensorboard`."""

import shutil
import struct
import time

import pytest
from axplug_testing import (
    cli_main,
    expected_writer_scalars,
    scalars_match,
    tiny_train_args,
    tiny_trainer_config,
    train_config,
)

from axplug.api.config import REQUIRED, find_configs, from_dict, to_dict
from axplug.api.summary import JsonlWriter, read_jsonl

pytest.importorskip("axplug_tensorboard")
from axplug_tensorboard import TensorBoardWriter  # noqa: E402


def tiny_run(tmp_path, *extra, steps=4, preset="gpt-tiny"):
    writers = [JsonlWriter.default_config(), TensorBoardWriter.default_config()]
    return tiny_trainer_config(
        tmp_path, "checkpoint_every=3", "log_every=1", *extra, max_steps=steps,
        preset=preset, summary_writers=writers,
    )  # fmt: skip


def read_events(path):
    """Events of a TFRecord event file: [u64 length][u32 crc][data][u32 crc] per record."""
    from tensorboardX.proto import event_pb2

    data, pos, events = path.read_bytes(), 0, []
    while pos < len(data):
        (length,) = struct.unpack("<Q", data[pos : pos + 8])
        events.append(event_pb2.Event.FromString(data[pos + 12 : pos + 12 + length]))
        pos += 12 + length + 4
    return events


def event_files(logdir):
    return sorted(logdir.glob("events.out.tfevents.*"))


def event_accumulator(logdir):
    """TensorBoard's own reader of a log directory (it applies purges as the UI does)."""
    ea = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    accumulator = ea.EventAccumulator(str(logdir), size_guidance={ea.SCALARS: 0})
    return accumulator.Reload()


# --- the tests ------------------------------------------------------------------------------


def test_event_file_holds_the_scalars(tmp_path):
    writer = TensorBoardWriter.default_config().set(dir=str(tmp_path)).instantiate()
    writer.write(1, {"loss": 2.5})
    writer.write(2, {"loss": 1.25, "lr": 0.1})
    writer.close()
    (path,) = event_files(tmp_path / "tensorboard")
    scalars = {
        (event.step, value.tag): value.simple_value
        for event in read_events(path)
        for value in event.summary.value
    }
    assert scalars == {
        (1, "train/loss"): 2.5,
        (2, "train/loss"): 1.25,
        (2, "train/lr"): pytest.approx(0.1),
    }


def test_resume_purges_the_replayed_steps(tmp_path):
    first = TensorBoardWriter.default_config().set(dir=str(tmp_path)).instantiate()
    for step in range(1, 6):
        first.write(step, {"loss": float(step)})
    first.close()
    time.sleep(1.1)  # event file names carry the second they were opened in
    resumed = TensorBoardWriter.default_config().set(dir=str(tmp_path)).instantiate()
    # No file before the first write: one opened here would outlive the purged one whenever
    # the clock's second turned before `truncate`.
    assert len(event_files(tmp_path / "tensorboard")) == 1
    resumed.truncate(3)  # resumed from the step-2 checkpoint: 3, 4, 5 are logged again
    resumed.write(3, {"loss": 30.0})
    resumed.truncate(4)  # after a write: no effect (the file has begun)
    resumed.close()
    files = event_files(tmp_path / "tensorboard")
    assert len(files) == 2
    events = list(read_events(files[1]))
    purges = [e.step for e in events if e.HasField("session_log") and e.session_log.status == 1]
    assert purges == [3]  # SessionLog.START at step 3: TensorBoard drops older events from 3 on
    assert [(e.step, v.simple_value) for e in events for v in e.summary.value] == [(3, 30.0)]


def test_a_nan_is_written_without_a_warning(tmp_path, caplog, capsys):
    writer = TensorBoardWriter.default_config().set(dir=str(tmp_path)).instantiate()
    writer.write(1, {"loss": float("nan")})
    writer.close()
    (path,) = event_files(tmp_path / "tensorboard")
    (value,) = [v.simple_value for e in read_events(path) for v in e.summary.value]
    assert value != value  # NaN, as logged
    captured = capsys.readouterr()
    assert "NaN or Inf" not in caplog.text + captured.err + captured.out


def test_a_run_writes_the_jsonl_scalars(tmp_path):
    final = tiny_run(tmp_path).instantiate().run()
    want = expected_writer_scalars(tmp_path, final)
    accumulator = event_accumulator(tmp_path / "tensorboard")
    got = {
        (event.step, tag): event.value
        for tag in accumulator.Tags()["scalars"]
        for event in accumulator.Scalars(tag)
    }
    assert scalars_match(got, want)


def test_a_killed_and_resumed_run_shows_each_step_once(tmp_path):
    tiny_run(tmp_path, steps=6).instantiate().run()
    # Killed after logging step 6, before its checkpoint committed: the latest is step 3.
    shutil.rmtree(tmp_path / "checkpoints" / "step_00000006")
    time.sleep(1.1)  # event file names carry the second they were opened in
    assert tiny_run(tmp_path, steps=8).instantiate().run()["step"] == 8
    events = event_accumulator(tmp_path / "tensorboard").Scalars("train/loss")
    assert [e.step for e in events] == list(range(1, 9))  # 4, 5, 6 once, from the resumed run
    records = [r for r in read_jsonl(tmp_path / "metrics.jsonl") if "loss" in r]
    assert [r["step"] for r in records] == list(range(1, 9))
    assert [e.value for e in events] == pytest.approx([r["loss"] for r in records], rel=1e-6)


def test_the_routers_summaries_are_a_moe_section_with_a_histogram(tmp_path):
    pytest.importorskip("axplug_moe")
    import jax

    cfg = tiny_run(
        tmp_path, "model.decoder.transformer.num_layers=2", "input.seq_len=16",
        preset="moe-tiny", steps=1,
    )  # fmt: skip
    for _, router in find_configs(cfg, "axplug_moe.router:TopKRouter"):
        router.capacity_factor = 0.25  # a quarter of the room: most tokens dropped
    cfg.instantiate(devices=jax.devices()[:1]).run()
    (record,) = [r for r in read_jsonl(tmp_path / "metrics.jsonl") if "loss" in r]
    accumulator = event_accumulator(tmp_path / "tensorboard")
    (event,) = accumulator.Scalars("moe/dropped_fraction")
    assert event.step == 1 and event.value == pytest.approx(record["moe/dropped_fraction"])
    (hist,) = accumulator.Histograms("moe/expert_load")
    assert hist.histogram_value.num == 2 * 8  # two routers' per-expert loads
    assert hist.histogram_value.sum == pytest.approx(2.0, rel=1e-5)  # each layer's sum to 1
    assert "train/loss" in accumulator.Tags()["scalars"]


def tiny_run_args(out, *extra, steps=2):
    return [*tiny_train_args(out, *extra, max_steps=steps), "--mesh-rule", "none", "-q"]


def test_the_writer_flag_adds_it_and_a_diverging_run_stays_quiet(tmp_path, capsys):
    cfg = train_config(["--preset", "gpt-tiny", "--mesh-rule", "none", "--writer", "tensorboard"])
    added = cfg.summary_writers[-1]
    assert added.klass is TensorBoardWriter and added.dir is REQUIRED  # the run directory
    assert len(cfg.summary_writers) == 3  # jsonl, progress, tensorboard

    out = tmp_path / "nan"
    args = tiny_run_args(out, "learner.learning_rate=1e30", "log_every=1", steps=8)
    assert cli_main([*args, "--writer", "tensorboard"]) == 1  # stopped by the NaN guard
    err = capsys.readouterr().err
    assert "error: stopping at step" in err and "Traceback" not in err
    assert "NaN or Inf found" not in err  # tensorboardX's warning kept quiet
    assert event_files(out / "tensorboard")  # OUTPUT_DIR/tensorboard, the writer's default


def test_a_config_saved_with_the_cores_old_class_loads(tmp_path):
    """Runs written while the writer was the core's name `axplug.summary.tensorboard`."""
    saved = to_dict(TensorBoardWriter.default_config().set(dir=str(tmp_path), flush_secs=5))
    saved["klass"] = "axplug.summary.tensorboard:TensorBoardWriter"
    loaded = from_dict(saved)
    assert loaded.klass is TensorBoardWriter and loaded.flush_secs == 5
