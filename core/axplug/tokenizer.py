"""Tokenizers behind one small interface: bytes, Hugging Face `tokenizer.json`, SentencePiece
`.model` and tiktoken `.tiktoken` rank files. The three file formats need optional packages
(`pip install 'axplug[tokenizers]'`); bytes need nothing."""

from __future__ import annotations

import base64
import json
import pathlib
import shutil
from collections.abc import Sequence

from axplug.config import ConfigDependencyError, ConfigError, ConfigFileError, ConfigValueError

__all__ = [
    "Tokenizer",
    "ByteTokenizer",
    "HFTokenizer",
    "SentencePieceTokenizer",
    "TiktokenTokenizer",
    "load_tokenizer",
    "has_tokenizer",
    "read_tokenizer_config",
    "TOKENIZER_FILES",
]

# The file names a tokenizer takes inside a data or model directory.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer.tiktoken")
_EOS_NAMES = ("</s>", "<|endoftext|>", "<eos>", "<|end_of_text|>", "<|eot_id|>")
_BOS_NAMES = ("<s>", "<|begin_of_text|>", "<bos>")
_PAD_NAMES = ("<pad>", "<|pad|>", "[PAD]")


class Tokenizer:
    """Text <-> token ids. `vocab_size` bounds every id; special ids are None when absent."""

    name = "tokenizer"
    vocab_size: int
    bos_id: int | None = None
    eos_id: int | None = None
    pad_id: int | None = None
    source: pathlib.Path | None = None  # the file it was read from
    file_name = ""  # its name in a data directory

    def encode(self, text: str) -> list[int]:
        """The ids of `text`, without special tokens."""
        raise NotImplementedError

    def decode(self, ids: Sequence[int]) -> str:
        """The text of `ids`; bytes that are not valid UTF-8 become U+FFFD."""
        raise NotImplementedError

    def save(self, directory: str | pathlib.Path) -> pathlib.Path:
        """Copies the tokenizer's file(s) into `directory`; returns the main file's path."""
        if self.source is None:
            raise ValueError(f"{type(self).__name__} has no file to save")
        directory = pathlib.Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        target = directory / self.file_name
        if self.source.resolve() != target.resolve():
            shutil.copyfile(self.source, target)
        config = self.source.with_name("tokenizer_config.json")
        if config.is_file() and config.resolve() != (directory / config.name).resolve():
            shutil.copyfile(config, directory / config.name)
        return target

    def describe(self) -> str:
        specials = ", ".join(
            f"{n}={v}" for n, v in (("bos", self.bos_id), ("eos", self.eos_id)) if v is not None
        )
        return f"{self.name} (vocab {self.vocab_size}{', ' + specials if specials else ''})"


class ByteTokenizer(Tokenizer):
    """UTF-8 bytes: vocab 256, no special tokens."""

    name = "bytes"
    vocab_size = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")


def _special(vocab: dict[str, int], config: dict, key: str, names: tuple[str, ...]) -> int | None:
    token = config.get(key)
    if isinstance(token, dict):  # {"content": "</s>", ...}
        token = token.get("content")
    if isinstance(token, str) and token in vocab:
        return vocab[token]
    return next((vocab[n] for n in names if n in vocab), None)


def read_tokenizer_config(path: pathlib.Path) -> dict:
    """A `tokenizer_config.json` (special tokens), {} when missing; one not a JSON object fails
    naming it."""
    if not path.is_file():
        return {}
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise ConfigValueError(f"{path}: not a readable tokenizer_config.json ({exc})") from None
    if not isinstance(config, dict):
        raise ConfigValueError(f"{path}: not a JSON object (a tokenizer_config.json maps names)")
    return config


class HFTokenizer(Tokenizer):
    """A Hugging Face `tokenizer.json` (the `tokenizers` package); special tokens from a
    `tokenizer_config.json` beside it, else the usual names (`</s>`, `<|endoftext|>`...)."""

    name = "huggingface"
    file_name = "tokenizer.json"

    def __init__(self, path: str | pathlib.Path):
        from tokenizers import Tokenizer as _Tokenizer

        self.source = pathlib.Path(path)
        self._tok = _Tokenizer.from_file(str(self.source))
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        vocab = self._tok.get_vocab(with_added_tokens=True)
        config = read_tokenizer_config(self.source.with_name("tokenizer_config.json"))
        self.bos_id = _special(vocab, config, "bos_token", _BOS_NAMES)
        self.eos_id = _special(vocab, config, "eos_token", _EOS_NAMES)
        self.pad_id = _special(vocab, config, "pad_token", _PAD_NAMES)

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)


class SentencePieceTokenizer(Tokenizer):
    """A SentencePiece `.model` (the `sentencepiece` package)."""

    name = "sentencepiece"
    file_name = "tokenizer.model"

    def __init__(self, path: str | pathlib.Path):
        import sentencepiece

        self.source = pathlib.Path(path)
        self._sp = sentencepiece.SentencePieceProcessor(model_file=str(self.source))
        self.vocab_size = self._sp.get_piece_size()
        for attr, value in (("bos_id", self._sp.bos_id()), ("eos_id", self._sp.eos_id()),
                            ("pad_id", self._sp.pad_id())):  # fmt: skip
            setattr(self, attr, value if value >= 0 else None)

    def encode(self, text: str) -> list[int]:
        return list(self._sp.encode(text))

    def decode(self, ids: Sequence[int]) -> str:
        return self._sp.decode([int(i) for i in ids])


class TiktokenTokenizer(Tokenizer):
    """A tiktoken BPE rank file (`base64-token rank` per line, as tiktoken ships them), split
    by the GPT-2 pattern; `<|endoftext|>` is the id after the last rank (the EOS)."""

    name = "tiktoken"
    file_name = "tokenizer.tiktoken"

    def __init__(self, path: str | pathlib.Path):
        import tiktoken
        from tiktoken_ext.openai_public import r50k_pat_str

        self.source = pathlib.Path(path)
        ranks = {}
        for number, line in enumerate(self.source.read_bytes().splitlines(), 1):
            if not line.strip():
                continue
            try:
                token, rank = line.split()
                ranks[base64.b64decode(token)] = int(rank)
            except ValueError as e:
                raise ValueError(f"{self.source}:{number}: not a tiktoken rank line") from e
        self.eos_id = max(ranks.values()) + 1
        self._enc = tiktoken.Encoding(
            name=self.source.stem,
            pat_str=r50k_pat_str,
            mergeable_ranks=ranks,
            special_tokens={"<|endoftext|>": self.eos_id},
        )
        self.vocab_size = self._enc.n_vocab

    def encode(self, text: str) -> list[int]:
        return self._enc.encode_ordinary(text)

    def decode(self, ids: Sequence[int]) -> str:
        return self._enc.decode([int(i) for i in ids], errors="replace")


_BY_SUFFIX = {
    ".json": HFTokenizer,
    ".model": SentencePieceTokenizer,
    ".tiktoken": TiktokenTokenizer,
}
_EXTRA = {HFTokenizer: "tokenizers", SentencePieceTokenizer: "sentencepiece",
          TiktokenTokenizer: "tiktoken"}  # fmt: skip
_KIND = {HFTokenizer: "Hugging Face tokenizer.json", SentencePieceTokenizer: "SentencePiece model",
         TiktokenTokenizer: "tiktoken rank file"}  # fmt: skip


def has_tokenizer(directory: str | pathlib.Path | None) -> bool:
    """Whether `directory` holds one of `TOKENIZER_FILES`."""
    return directory is not None and any(
        (pathlib.Path(directory) / name).is_file() for name in TOKENIZER_FILES
    )


def load_tokenizer(spec: str | pathlib.Path) -> Tokenizer:
    """`bytes`, a tokenizer file (`tokenizer.json`, `*.model`, `*.tiktoken`) or a directory
    holding one of `TOKENIZER_FILES` (a prepared data directory, a Hugging Face model) or
    data prepared with bytes."""
    if str(spec) == "bytes":
        return ByteTokenizer()
    path = pathlib.Path(spec).expanduser()
    if path.is_dir():
        found = [path / name for name in TOKENIZER_FILES if (path / name).is_file()]
        meta = path / "meta.json"
        prepared = json.loads(meta.read_text()) if not found and meta.is_file() else {}
        if prepared.get("tokenizer") == "bytes":  # data prepared with bytes
            return ByteTokenizer()
        if not found:
            raise ConfigFileError(
                f"tokenizer: {str(path)!r} holds none of {', '.join(TOKENIZER_FILES)}"
            )
        path = found[0]
    if not path.is_file():
        raise ConfigFileError(
            f"tokenizer: {str(path)!r} does not exist; give 'bytes', a tokenizer.json, a "
            "SentencePiece .model, a .tiktoken file or a directory with one of them"
        )
    cls = _BY_SUFFIX.get(path.suffix)
    if cls is None:
        raise ConfigValueError(
            f"tokenizer: {str(path)!r} is none of tokenizer.json, *.model (SentencePiece), "
            "*.tiktoken"
        )
    try:
        return cls(path)
    except ImportError as e:
        raise ConfigDependencyError(
            f"tokenizer {str(path)!r} needs the {_EXTRA[cls]!r} package: "
            "pip install 'axplug[tokenizers]'"
        ) from e
    except ConfigError:
        raise
    except Exception as e:  # the format's own parser: any error it has means a bad file
        reason = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise ConfigValueError(
            f"tokenizer {str(path)!r}: not a readable tokenizer ({reason}); give a valid "
            f"{_KIND[cls]} (a truncated or damaged copy?)"
        ) from None
