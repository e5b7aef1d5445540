"""Damaged data directories and prepare-data mistakes: refused in one `error:` line naming the
file, before a step trains or anything is written (issue 32)."""

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
from axplug_testing import tiny_train_args

from axplug.cli import main
from axplug.input import bundled_corpus_path
from axplug.input.prepare import prepare_data

TEXT = bundled_corpus_path().read_text(encoding="utf-8")[:60_000]


@pytest.fixture(scope="module")
def clean(tmp_path_factory):
    """A bytes-tokenized directory of 32 shards (15 paragraphs each), prepared once."""
    root = tmp_path_factory.mktemp("clean")
    (root / "corpus.txt").write_text(TEXT, encoding="utf-8")
    prepare_data([root / "corpus.txt"], tokenizer="bytes", output=root / "data",
                 text_unit="paragraph", docs_per_shard=15, workers=1)  # fmt: skip
    return root / "data"


@pytest.fixture
def data(clean, tmp_path):
    """A copy of the clean directory, for a test to damage."""
    return shutil.copytree(clean, tmp_path / "data")


def error_line(err: str) -> str:
    """The one `error:` line of a command's stderr (and no traceback)."""
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def train(data, run, capsys) -> tuple[int, str]:
    """`axplug train` of the tiny model on `data` for 2 steps: (exit code, stderr)."""
    args = [*tiny_train_args(run), "--mesh-rule", "none", "-q"]
    code = main([*args, "--input", f"token_file:path={str(data)!r},packing=True"])
    return code, capsys.readouterr().err


def assert_nothing_trained(run) -> None:
    assert not (run / "checkpoints").exists() and not (run / "config.txt").exists()


def meta_of(data) -> dict:
    return json.loads((data / "meta.json").read_text())


def edit_meta(data, **fields) -> None:
    (data / "meta.json").write_text(json.dumps({**meta_of(data), **fields}))


# -- 1. a damaged directory trains silently ---------------------------------------------------


def test_truncated_shards_are_refused_naming_the_first(data, tmp_path, capsys):
    for i in (4, 11, 27):  # 3 of 32 cut short, as an interrupted cp/rsync leaves them
        shard = data / f"shard_{i:05d}.bin"
        size = shard.stat().st_size
        with open(shard, "r+b") as f:
            f.truncate(size // 2 - size // 2 % 2)
    tokens = meta_of(data)["shards"][4]["tokens"]
    code, err = train(data, tmp_path / "run", capsys)
    assert code == 2
    assert error_line(err) == (
        f"error: {data}/shard_00004.bin: {tokens // 2} tokens, meta.json says {tokens} "
        "(an incomplete copy?): copy it again or rerun prepare-data"
    )
    assert_nothing_trained(tmp_path / "run")


def test_an_older_directory_checks_its_shards_against_their_document_offsets(data, tmp_path,
                                                                             capsys):  # fmt: skip
    meta = meta_of(data)
    for shard in meta["shards"]:  # as written before meta.json recorded tokens and largest ids
        del shard["tokens"], shard["max_token_id"]
    edit_meta(data, shards=meta["shards"])
    shard = data / "shard_00007.bin"
    size = shard.stat().st_size
    with open(shard, "r+b") as f:
        f.truncate(size - 200)
    code, err = train(data, tmp_path / "run", capsys)
    assert code == 2
    line = error_line(err)
    assert line.startswith(f"error: {data}/shard_00007.docs.npy: document offsets run from 0 to ")
    assert f"but shard_00007.bin holds {(size - 200) // 2} tokens (an incomplete copy?)" in line
    assert_nothing_trained(tmp_path / "run")


def test_ids_outside_the_vocabulary_are_refused_not_clamped(clean, data, tmp_path, capsys):
    tokens = meta_of(data)["shards"][7]["tokens"]
    np.full(tokens, 60000, np.uint16).tofile(data / "shard_00007.bin")  # every token of a shard
    code, err = train(data, tmp_path / "run", capsys)
    assert code == 2
    assert error_line(err) == (
        f"error: {data}/shard_00007.bin: token id 60000 at token 0 is outside the vocabulary of "
        f"256 (meta.json's vocab_size; a damaged shard?): check it with `axplug data verify "
        f"{data}`, then copy it again or rerun prepare-data"
    )
    assert_nothing_trained(tmp_path / "run")
    # A meta.json whose vocabulary is smaller than the ids it records is refused on opening.
    fresh = shutil.copytree(clean, tmp_path / "small")
    largest = meta_of(fresh)["shards"][0]["max_token_id"]
    edit_meta(fresh, vocab_size=100)
    code, err = train(fresh, tmp_path / "run2", capsys)
    assert code == 2
    assert error_line(err) == (
        f"error: {fresh}/shard_00000.bin: token ids up to {largest} (meta.json), outside the "
        "vocabulary of 100 (meta.json's vocab_size): the shard was prepared with another "
        "tokenizer; rerun prepare-data"
    )
    assert_nothing_trained(tmp_path / "run2")


def test_a_batch_with_ids_outside_the_vocabulary_is_refused(data):
    from axplug.config import ConfigFileError
    from axplug.input.token_file import TokenFileInput

    for shard in data.glob("shard_*.bin"):
        tokens = np.fromfile(shard, np.uint16)
        tokens[1:-1] = 60000  # all but the first and last tokens, which opening reads
        tokens.tofile(shard)
    cfg = TokenFileInput.default_config().set(path=str(data), seq_len=32, batch_size=4)
    inp = cfg.instantiate()
    with pytest.raises(ConfigFileError, match=r"shard_000\d\d.bin: token id 60000 at token \d+ "
                       "is outside the vocabulary of 256 .*axplug data verify"):  # fmt: skip
        inp.batch(0)


def test_data_verify_reads_every_shard(data, capsys):
    meta = meta_of(data)
    assert main(["data", "verify", str(data)]) == 0
    largest = max(s["max_token_id"] for s in meta["shards"])
    assert capsys.readouterr().out == (
        f"{data}: ok, 32 shard(s), {meta['num_documents']:,} documents, "
        f"{meta['num_tokens']:,} uint16 tokens, largest id {largest} < 256\n"
    )
    assert main(["data", "verify", str(data), "--vocab-size", "100"]) == 2
    line = error_line(capsys.readouterr().err)
    assert line.startswith(f"error: {data}/shard_00000.bin: token id ")
    assert line.endswith("is outside the vocabulary of 100 (--vocab-size): copy it again or "
                         "rerun prepare-data")  # fmt: skip
    # One token changed in place: the sizes still match, the largest id does not.
    tokens = np.fromfile(data / "shard_00012.bin", np.uint16)
    tokens[123] = 60000
    tokens.tofile(data / "shard_00012.bin")
    assert main(["data", "verify", str(data)]) == 2
    assert error_line(capsys.readouterr().err) == (
        f"error: {data}/shard_00012.bin: largest token id 60000, meta.json says "
        f"{meta['shards'][12]['max_token_id']} (changed after prepare-data?): copy it again or "
        "rerun prepare-data"
    )
    assert main(["data", "verify", str(data), "--vocab-size", "0"]) == 2
    assert error_line(capsys.readouterr().err) == "error: --vocab-size must be >= 1, got 0"


# -- 2. one error line, naming the file, instead of a traceback -------------------------------


def _truncate_meta(data):
    text = (data / "meta.json").read_text()
    (data / "meta.json").write_text(text[: len(text) // 2])


def _odd_shard(data):
    with open(data / "shard_00003.bin", "ab") as f:
        f.write(b"\0")


DAMAGE = {
    "truncated meta.json": (_truncate_meta, "meta.json: not JSON ("),
    "odd-sized shard": (_odd_shard, "shard_00003.bin: {size} bytes, not a whole number of uint16"),
    "missing docs.npy": (
        lambda d: (d / "shard_00009.docs.npy").unlink(),
        "shard_00009.docs.npy: missing (the document offsets of shard_00009.bin)",
    ),
    "dtype float64": (
        lambda d: edit_meta(d, dtype="float64"),
        "meta.json: dtype 'float64', expected one of ('uint16', 'uint32')",
    ),
    "vocab_size -5": (
        lambda d: edit_meta(d, vocab_size=-5),
        "meta.json: vocab_size -5, expected an integer >= 1",
    ),
    "shards abc": (
        lambda d: edit_meta(d, shards="abc"),
        "meta.json: shards 'abc', expected a list of shard records",
    ),
}


@pytest.mark.parametrize("case", list(DAMAGE))
def test_damage_is_one_error_line_naming_the_file(data, tmp_path, capsys, case):
    damage, message = DAMAGE[case]
    damage(data)
    code, err = train(data, tmp_path / "run", capsys)
    assert code == 2
    size = (data / "shard_00003.bin").stat().st_size
    assert error_line(err).startswith(f"error: {data}/{message.format(size=size)}"), err
    assert_nothing_trained(tmp_path / "run")
    assert main(["data", "verify", str(data)]) == 2
    assert error_line(capsys.readouterr().err).startswith(f"error: {data}/")


# -- 3. prepare-data checks its inputs before writing, and names the file and line -----------


@pytest.fixture
def corpus(tmp_path):
    path = tmp_path / "corpus.jsonl"
    lines = [json.dumps({"text": p}) for p in TEXT.split("\n\n")[:40]]
    path.write_text("\n".join(lines) + "\n")
    return path


def prepare(*argv) -> int:
    return main(["prepare-data", *map(str, argv)])


def test_a_garbage_tokenizer_is_one_line_naming_it(tmp_path, corpus, capsys):
    pytest.importorskip("tokenizers")
    pytest.importorskip("sentencepiece")
    out = tmp_path / "out"
    garbage = {"not JSON": ("tokenizer.json", b"garbage"),
               "JSON, not a tokenizer": ("tokenizer.json", b'{"a": 1}'),
               "SentencePiece": ("tokenizer.model", os.urandom(300))}  # fmt: skip
    for case, (name, content) in garbage.items():
        tok = tmp_path / case / name
        tok.parent.mkdir()
        tok.write_bytes(content)
        for spec in (tok, tok.parent):  # the file, or a directory holding it
            assert prepare(corpus, "--tokenizer", spec, "--output", out) == 2, case
            line = error_line(capsys.readouterr().err)
            assert line.startswith(f"error: tokenizer '{tok}': not a readable tokenizer ("), line
            assert not out.exists(), case


def test_a_truncated_jsonl_line_names_file_and_line(tmp_path, corpus, capsys):
    with open(corpus, "a") as f:
        f.write('{"text": "an interrupted wri')
    out = tmp_path / "out"
    assert prepare(corpus, "--tokenizer", "bytes", "--output", out, "--docs-per-shard", "7",
                   "--workers", "1") == 2  # fmt: skip
    line = error_line(capsys.readouterr().err)
    assert line.startswith(f"error: {corpus}:41: not a JSON line (Unterminated string "), line
    assert line.endswith("a truncated line?): fix or remove it")
    assert not out.exists()  # the shards before it are gone with the directory this run made


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--workers", "-3"], "error: --workers must be >= 1, got -3"),
        (["--docs-per-shard", "0"], "error: --docs-per-shard must be >= 1, got 0"),
    ],
)
def test_bad_arguments_are_usage_errors(tmp_path, corpus, capsys, argv, message):
    out = tmp_path / "out"
    assert prepare(corpus, "--tokenizer", "bytes", "--output", out, *argv) == 2
    assert error_line(capsys.readouterr().err) == message
    assert not out.exists()


def test_an_output_that_is_a_file_is_one_line(tmp_path, corpus, capsys):
    out = tmp_path / "out.txt"
    out.write_text("mine")
    for target in (out, out / "sub"):
        assert prepare(corpus, "--tokenizer", "bytes", "--output", target) == 2
        assert error_line(capsys.readouterr().err) == (
            f"error: prepare-data: --output {str(target)!r}: {str(out)!r} is a file, not a "
            "directory; give a new directory (or the one a killed run left)"
        )
    assert out.read_text() == "mine"


# A disk that fills while a shard is written: the file size limit makes numpy's `tofile` fail
# as a full disk does (`OSError: N requested and M written`, no errno); SIGXFSZ ignored, so the
# write fails instead of killing the process.
FULL_DISK = """
import resource, signal, sys
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (20_000, resource.RLIM_INFINITY))
from axplug.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_a_full_disk_is_one_line_and_the_rerun_completes(tmp_path, capsys):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(TEXT, encoding="utf-8")
    argv = ["prepare-data", str(corpus), "--tokenizer", "bytes", "--text-unit", "paragraph",
            "--docs-per-shard", "200", "--workers", "1"]  # fmt: skip
    out = tmp_path / "out"
    done = subprocess.run([sys.executable, "-c", FULL_DISK, *argv, "--output", str(out)],
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode == 1, done.stderr
    line = error_line(done.stderr)
    assert "no space left" in line.lower() and f"{out}/shard_00000.bin" in line, line
    assert sorted(p.name for p in out.iterdir()) == ["progress.json"]  # no shard, no temp file
    assert main([*argv, "--output", str(out)]) == 0  # room again: the rerun completes
    assert main([*argv, "--output", str(tmp_path / "clean")]) == 0
    capsys.readouterr()
    for path in (tmp_path / "clean").iterdir():
        assert (out / path.name).read_bytes() == path.read_bytes(), path.name


def test_a_full_disk_copying_the_tokenizer_names_the_copy(tmp_path, corpus, capsys, monkeypatch):
    pytest.importorskip("tokenizers")
    import errno

    from tokenizer_files import hf_bpe

    tok = hf_bpe(tmp_path / "tok")

    def full(src, dst, **kwargs):
        error = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        error.filename, error.filename2 = str(src), str(dst)  # as shutil's sendfile sets them
        raise error

    monkeypatch.setattr("axplug.tokenizer.shutil.copyfile", full)
    out = tmp_path / "out"
    assert prepare(corpus, "--tokenizer", tok, "--output", out, "--workers", "1") == 1
    line = error_line(capsys.readouterr().err)
    assert "no space left" in line.lower() and f"{out}/tokenizer.json" in line, line
    assert str(tok) not in line  # the file being written, not the one read
    assert not (out / "meta.json").exists()
