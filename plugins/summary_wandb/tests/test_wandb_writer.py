"""axplug-wandb against the run's metrics.jsonl: offline run files read back (protobuf
records), scalars, histograms and resumed steps."""

import json
import pathlib
import time

import pytest
from axplug_testing import (
    expected_writer_scalars,
    scalars_match,
    tiny_trainer_config,
)

from axplug.api.summary import JsonlWriter


def tiny_run(tmp_path, writers, *extra, steps=4):
    return tiny_trainer_config(
        tmp_path, "checkpoint_every=2", "log_every=1", *extra, max_steps=steps,
        summary_writers=[JsonlWriter.default_config(), *writers],
    )  # fmt: skip


def wandb_records(path: pathlib.Path):
    """Protobuf records of a `.wandb` file: a 7-byte W&B header, then LevelDB log records
    ([u32 crc][u16 length][u8 type][data], in 32 KiB blocks; FIRST/MIDDLE/LAST chunks)."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    pos, block, chunks = 7, 32 * 1024, b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        length, kind = int.from_bytes(data[pos + 4 : pos + 6], "little"), data[pos + 6]
        if pos + 7 + length > len(data):
            return  # a record W&B's service is still writing
        chunks += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # FULL or LAST
            record = wandb_internal_pb2.Record()
            record.ParseFromString(chunks)
            yield record
            chunks = b""


def wandb_history(run_dir: pathlib.Path) -> tuple[dict, dict]:
    """({(step, key): scalar}, {(step, key): histogram counts}) of the offline runs in DIR/wandb."""
    scalars, histograms = {}, {}
    for path in sorted((run_dir / "wandb").glob("offline-run-*/run-*.wandb")):
        for record in wandb_records(path):
            if record.WhichOneof("record_type") != "history":
                continue
            step = record.history.step.num
            for item in record.history.item:
                key = item.key or "/".join(item.nested_key)
                if key.startswith("_"):  # W&B's own _step, _runtime, _timestamp
                    continue
                value = json.loads(item.value_json)
                if len(item.nested_key) > 1:  # a histogram: {name: {_type, bins, values}}
                    histograms.setdefault((step, item.nested_key[0]), {})[item.nested_key[1]] = (
                        value
                    )
                else:
                    scalars[(step, key)] = value
    return scalars, histograms


def wandb_history_once(run_dir: pathlib.Path, written) -> tuple[dict, dict]:
    """`wandb_history(run_dir)` once `written(scalars, histograms)` holds, or after 30 s: W&B's
    service process writes the offline file after `finish()` returns, under load seconds later
    (2 of 6 full-suite runs read no history at once, one read a record half written)."""
    deadline = time.monotonic() + 30
    while not written(*(history := wandb_history(run_dir))) and time.monotonic() < deadline:
        time.sleep(0.2)
    return history


def wandb_writer(**kwargs):
    pytest.importorskip("axplug_wandb")
    from axplug_wandb import WandbWriter

    return WandbWriter.default_config().set(mode="offline", **kwargs)


@pytest.fixture
def wandb_env(monkeypatch, tmp_path):
    # No network, no login, no settings from the developer's home.
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb-config"))
    monkeypatch.setenv("WANDB_CACHE_DIR", str(tmp_path / "wandb-cache"))


# --- the tests ------------------------------------------------------------------------------


def test_wandb_offline_receives_the_jsonl_scalars(tmp_path, wandb_env):
    out = tmp_path / "run"
    final = tiny_run(out, [wandb_writer(project="tests")]).instantiate().run()
    want = expected_writer_scalars(out, final)
    scalars, _ = wandb_history_once(out, lambda scalars, _: scalars.keys() >= want.keys())
    assert scalars_match(scalars, want)
    assert (out / "wandb-run-id").read_text().strip()


def test_wandb_writes_histograms_and_skips_steps_it_has(tmp_path, wandb_env):
    import numpy as np

    cfg = wandb_writer(dir=str(tmp_path))
    with cfg.instantiate() as writer:
        writer.write(5, {"loss": 1.0})
        writer.write_histograms(5, {"moe/expert_load": np.array([0.1, 0.2, 0.3, 0.4])})
        writer.write(3, {"loss": 7.0})  # behind the run: dropped, not a W&B warning
    scalars, histograms = wandb_history_once(tmp_path, lambda scalars, hists: scalars and hists)
    assert scalars == {(5, "train/loss"): 1.0}
    (step, key), hist = next(iter(histograms.items()))
    assert (step, key) == (5, "moe/expert_load") and sum(hist["values"]) == 4
