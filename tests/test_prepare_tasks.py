"""`prepare-data --num-tasks N --task-index I`: N processes make the dataset one process makes."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from axplug.cli import main
from axplug.input.token_file import TokenFileInput
from tokenizer_files import SAMPLE, hf_bpe


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("corpus")
    paragraphs = [p for p in SAMPLE[:60_000].split("\n\n") if p.strip()]
    third = len(paragraphs) // 3
    sources = []
    for i, part in enumerate((paragraphs[:third], paragraphs[third : 2 * third],
                              paragraphs[2 * third :])):  # fmt: skip
        path = root / f"part{i}.jsonl"
        path.write_text("".join(json.dumps({"text": p}) + "\n" for p in part))
        sources.append(str(path))
    pytest.importorskip("tokenizers")
    return sources, hf_bpe(root / "tok")


def _prepare(sources, tokenizer, output, *extra):
    return ["prepare-data", *sources, "--tokenizer", str(tokenizer), "--output", str(output),
            "--docs-per-shard", "7", "--workers", "1", *extra]  # fmt: skip


def _read_files(root):
    """What training reads: meta.json, the tokenizer and every shard file, by name."""
    meta = json.loads((root / "meta.json").read_text())
    names = ["meta.json", meta["tokenizer"]]
    for shard in meta["shards"]:
        names += [f"{shard['name']}.bin", f"{shard['name']}.docs.npy"]
    return {name: (root / name).read_bytes() for name in names}


def test_four_task_processes_make_the_single_process_dataset_byte_for_byte(tmp_path, corpus):
    sources, tokenizer = corpus
    assert main(_prepare(sources, tokenizer, tmp_path / "single")) == 0
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    procs = [
        subprocess.Popen([sys.executable, "-m", "axplug.cli",
                          *_prepare(sources, tokenizer, tmp_path / "tasks", "--num-tasks", "4",
                                    "--task-index", str(i))],
                         env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for i in range(4)
    ]  # fmt: skip
    outputs = [p.communicate(timeout=300)[0] for p in procs]
    assert [p.returncode for p in procs] == [0] * 4, outputs
    single, split = _read_files(tmp_path / "single"), _read_files(tmp_path / "tasks")
    assert len(json.loads(single["meta.json"])["shards"]) > 8  # every task made shards
    assert single.keys() == split.keys()
    assert all(single[name] == split[name] for name in single), [
        name for name in single if single[name] != split[name]
    ]
    batches = []
    for name in ("single", "tasks"):
        cfg = TokenFileInput.default_config().set(
            path=str(tmp_path / name), seq_len=16, batch_size=4, seed=3, packing=True
        )
        data = cfg.instantiate()
        batches.append([data.batch(step) for step in range(5)])
    for a, b in zip(*batches, strict=True):
        for key in a:
            np.testing.assert_array_equal(a[key], b[key])


def test_merge_waits_for_every_task_and_names_the_missing(tmp_path, corpus, capsys):
    sources, tokenizer = corpus
    out = tmp_path / "out"
    assert main(_prepare(sources, tokenizer, out, "--num-tasks", "3", "--task-index", "2")) == 0
    assert not (out / "meta.json").exists()  # not complete: tasks 0 and 1 are missing
    assert "meta.json comes when every task is done" in capsys.readouterr().out
    assert main(["prepare-data", "--merge", "--output", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "task(s) 0, 1 of 3 have not finished" in err
    for i in (0, 1):
        assert main(_prepare(sources, tokenizer, out, "--num-tasks", "3", "--task-index",
                             str(i))) == 0  # fmt: skip
    assert (out / "meta.json").exists()  # the last task merged
    merged = (out / "meta.json").read_bytes()
    assert main(["prepare-data", "--merge", "--output", str(out)]) == 0  # by hand: the same
    assert (out / "meta.json").read_bytes() == merged


def test_tasks_with_other_settings_are_refused_at_merge(tmp_path, corpus, capsys):
    sources, tokenizer = corpus
    out = tmp_path / "out"
    assert main(_prepare(sources, tokenizer, out, "--num-tasks", "2", "--task-index", "0")) == 0
    other = ["prepare-data", *sources, "--tokenizer", str(tokenizer), "--output",
             str(tmp_path / "elsewhere"), "--docs-per-shard", "5", "--workers", "1",
             "--num-tasks", "2", "--task-index", "1"]  # fmt: skip
    assert main(other) == 0
    (out / "tasks").joinpath("task_00001-of-00002.json").write_bytes(
        (tmp_path / "elsewhere" / "tasks" / "task_00001-of-00002.json").read_bytes()
    )
    assert main(["prepare-data", "--merge", "--output", str(out)]) == 2
    assert "other sources, settings or --num-tasks" in capsys.readouterr().err
    assert not (out / "meta.json").exists()


@pytest.mark.parametrize("flags", [["--num-tasks", "2", "--task-index", "2"],
                                   ["--num-tasks", "0"]])  # fmt: skip
def test_a_task_index_outside_the_tasks_is_one_error(tmp_path, corpus, capsys, flags):
    sources, tokenizer = corpus
    assert main(_prepare(sources, tokenizer, tmp_path / "out", *flags)) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: prepare-data: --") and not (tmp_path / "out").exists()
