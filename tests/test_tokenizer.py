"""Tokenizers: bytes, Hugging Face, SentencePiece and tiktoken files built in the test."""

import pytest

from axplug.tokenizer import (
    ByteTokenizer,
    HFTokenizer,
    SentencePieceTokenizer,
    TiktokenTokenizer,
    load_tokenizer,
)
from tokenizer_files import MERGES, SAMPLE, hf_bpe, sentencepiece_model, tiktoken_ranks

TEXTS = ["", "HAMLET. To be, or not to be", "naïve café — ünïcödé ✓\nsecond line\n", SAMPLE[:3000]]


def round_trips(tok):
    for text in TEXTS:
        ids = tok.encode(text)
        assert all(0 <= i < tok.vocab_size for i in ids)
        assert tok.decode(ids) == text, text[:40]


def test_bytes():
    tok = load_tokenizer("bytes")
    assert isinstance(tok, ByteTokenizer) and tok.vocab_size == 256 and tok.eos_id is None
    assert tok.encode("é") == [0xC3, 0xA9]
    round_trips(tok)


def test_data_prepared_with_bytes_reads_back_as_bytes(tmp_path):
    """A data directory holds no tokenizer file for bytes: its meta.json names them."""
    from axplug.input import prepare_data

    (tmp_path / "text.txt").write_text("To be, or not to be")
    prepare_data([tmp_path / "text.txt"], tokenizer="bytes", output=tmp_path / "data")
    assert isinstance(load_tokenizer(tmp_path / "data"), ByteTokenizer)
    (tmp_path / "data" / "meta.json").write_text('{"format": "axplug-tokens-1"}')
    with pytest.raises(FileNotFoundError, match="holds none of tokenizer.json"):
        load_tokenizer(tmp_path / "data")


def test_hugging_face_tokenizer_json(tmp_path):
    pytest.importorskip("tokenizers")
    path = hf_bpe(tmp_path / "hf")
    tok = load_tokenizer(tmp_path / "hf")  # a directory holding tokenizer.json
    assert isinstance(tok, HFTokenizer) and tok.vocab_size == 400
    assert (tok.pad_id, tok.bos_id, tok.eos_id) == (0, 1, 2)
    assert len(tok.encode(SAMPLE[:3000])) < 0.75 * len(SAMPLE[:3000].encode())  # it merges
    round_trips(tok)
    saved = tok.save(tmp_path / "data")
    assert saved.name == "tokenizer.json" and saved.read_bytes() == path.read_bytes()


def test_sentencepiece_model(tmp_path):
    pytest.importorskip("sentencepiece")
    path = sentencepiece_model(tmp_path / "sp")
    tok = load_tokenizer(path)
    assert isinstance(tok, SentencePieceTokenizer) and tok.vocab_size == 500
    assert (tok.bos_id, tok.eos_id, tok.pad_id) == (1, 2, 3)
    round_trips(tok)  # byte fallback: the unicode that training never saw too
    assert tok.save(tmp_path / "data").name == "tokenizer.model"
    assert isinstance(load_tokenizer(tmp_path / "data"), SentencePieceTokenizer)


def test_tiktoken_rank_file(tmp_path):
    pytest.importorskip("tiktoken")
    tok = load_tokenizer(tiktoken_ranks(tmp_path))
    assert isinstance(tok, TiktokenTokenizer)
    assert tok.vocab_size == 256 + len(MERGES) + 1 and tok.eos_id == 256 + len(MERGES)
    assert tok.encode("the") == [256 + MERGES.index(b"the")]
    assert tok.encode(" the") == [256 + MERGES.index(b" the")]
    round_trips(tok)


def test_bad_paths_say_what_is_accepted(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist; give 'bytes', a tokenizer.json"):
        load_tokenizer(tmp_path / "nope.json")
    with pytest.raises(FileNotFoundError, match="holds none of tokenizer.json"):
        load_tokenizer(tmp_path)
    (tmp_path / "vocab.txt").write_text("x")
    with pytest.raises(ValueError, match="is none of tokenizer.json"):
        load_tokenizer(tmp_path / "vocab.txt")
