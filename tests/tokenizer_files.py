"""Real tokenizer files built on the spot from the bundled corpus (no downloads): a byte-level
BPE `tokenizer.json`, a SentencePiece `.model`, a tiktoken rank file."""

from __future__ import annotations

import base64
import pathlib

from axplug.input import bundled_corpus_path

SAMPLE = bundled_corpus_path().read_text(encoding="utf-8")[:200_000]


def hf_bpe(directory: pathlib.Path, vocab_size: int = 400) -> pathlib.Path:
    """A byte-level BPE with `<s>`, `</s>`, `<pad>` specials; exact round trips."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<pad>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(SAMPLE.splitlines(), trainer=trainer)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "tokenizer.json"
    tok.save(str(path))
    return path


def sentencepiece_model(directory: pathlib.Path, vocab_size: int = 500) -> pathlib.Path:
    """A BPE SentencePiece model with byte fallback and no normalization: exact round trips."""
    import sentencepiece

    directory.mkdir(parents=True, exist_ok=True)
    text = directory / "sp_train.txt"
    text.write_text(SAMPLE, encoding="utf-8")
    sentencepiece.SentencePieceTrainer.train(
        input=str(text), model_prefix=str(directory / "sp"), vocab_size=vocab_size,
        model_type="bpe", byte_fallback=True, normalization_rule_name="identity",
        add_dummy_prefix=False, remove_extra_whitespaces=False, split_by_whitespace=True,
        pad_id=3, minloglevel=2,
    )  # fmt: skip
    return directory / "sp.model"


MERGES = [b"th", b"he", b"the", b"in", b"an", b"and", b"er", b" t", b" the"]


def tiktoken_ranks(directory: pathlib.Path) -> pathlib.Path:
    """Every byte, then a few merges built from tokens already ranked."""
    tokens = [bytes([b]) for b in range(256)] + MERGES
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "tiny.tiktoken"
    lines = (f"{base64.b64encode(t).decode()} {rank}" for rank, t in enumerate(tokens))
    path.write_text("\n".join(lines) + "\n")
    return path
