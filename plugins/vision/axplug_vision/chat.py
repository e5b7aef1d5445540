"""Image-chat fine-tuning data (`axplug prepare-chat --images RUN`): user turns with OpenAI
content parts, each image as its model's placeholder tokens (masked out of the loss), and each
image's pixels stored at its placeholders as the `image_pixels` token values."""

from __future__ import annotations

import json
import os
import pathlib
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlsplit

import numpy as np

from axplug.api.config import ConfigError, ConfigValueError
from axplug_vision.model import VisionLanguageModel
from axplug_vision.prompts import expand_images, image_marker, image_pixels

__all__ = [
    "IMAGE_VALUES",
    "ImageChatEncoder",
    "image_model",
    "joined_parts",
    "pixel_width",
    "store_image_pixels",
]

IMAGE_VALUES = "image_pixels"  # the token values' name: `forward(image_pixels=...)` takes them


def _run_config(run_dir: str) -> Any:
    from axplug.api.checkpoint import Checkpointer, CheckpointError, checkpoint_directory
    from axplug.api.config import from_dict

    try:
        directory = checkpoint_directory(run_dir)
        with Checkpointer.default_config().set(directory=directory).instantiate() as checkpointer:
            saved = checkpointer.metadata(None).get("config")
    except CheckpointError as e:
        saved, why = None, str(e)
    else:
        why = "its checkpoint holds no trainer config"
    if saved is None:
        raise ConfigError(
            f"--images {run_dir}: not an axplug run directory ({why}); give an `axplug "
            "import-hf` of the model, or a run trained from one"
        )
    return from_dict(saved)


def image_model(run_dir: str) -> tuple[Any, list[str]]:
    """(the `VisionLanguageModel` config of the run at `run_dir`, the directories of that run
    and of the runs it was trained from, nearest first: where its image processor's settings
    are found)."""
    cfg = _run_config(run_dir)
    model, klass = cfg.model, getattr(cfg.model, "klass", None)
    if not (isinstance(klass, type) and issubclass(klass, VisionLanguageModel)):
        raise ConfigError(
            f"--images {run_dir}: its model ({getattr(klass, '__name__', klass)}) takes no "
            "images; give the run directory of a vision-language model (axplug-vision)"
        )
    directories = [run_dir]
    while (parent := cfg.restore.init_from) and len(directories) < 16:
        directories.append(parent)
        try:
            cfg = _run_config(parent)
        except ConfigError:
            break  # a run it was tuned from is gone: its lineage ends there
    return model, directories


def pixel_width(model: Any) -> int:
    """The pixel values each placeholder token of `model` (a `VisionLanguageModel` config)
    carries: an image's, split evenly over its placeholders."""
    tower, per_image = model.vision, VisionLanguageModel.fixed_tokens_per_image(model)
    values = tower.num_channels * tower.image_size**2
    if values % per_image:
        raise ConfigError(
            f"--images: an image's {values} pixel values do not split evenly over its "
            f"{per_image} placeholder tokens, so prepared data cannot carry them"
        )
    return values // per_image


def joined_parts(record: Any, marker_text: str) -> tuple[Any, list[tuple[str, str]]]:
    """(`record` with each message's content parts joined into one string, an image part as
    `marker_text`; [(url, where in the record)] of its images in order). A part is `{"type":
    "text", "text": ...}` or `{"type": "image_url", "image_url": {"url": ...}}` (OpenAI's);
    images are refused outside the user's turns, remote ones always."""
    if not isinstance(record, dict) or not isinstance(record.get("messages"), list):
        return record, []
    messages, urls = [], []
    for i, message in enumerate(record["messages"]):
        parts = message.get("content") if isinstance(message, dict) else None
        if not isinstance(parts, list):
            messages.append(message)
            continue
        pieces = []
        for j, part in enumerate(parts):
            where = f"messages[{i}].content[{j}]"
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "text" and isinstance(part.get("text"), str):
                pieces.append(part["text"])
                continue
            url = (part.get("image_url") or {}) if kind == "image_url" else None
            url = url.get("url") if isinstance(url, dict) else None
            if not isinstance(url, str):
                raise ConfigValueError(
                    f'{where}: a part is {{"type": "text", "text": ...}} or {{"type": '
                    '"image_url", "image_url": {"url": ...}}'
                )
            if message.get("role") != "user":
                raise ConfigValueError(f"{where}: an image in a {message.get('role')!r} turn; "
                                       "images go in the user's turns")  # fmt: skip
            if urlsplit(url).scheme.lower() not in ("", "file", "data"):
                raise ConfigValueError(
                    f"{where}: image {url[:80]!r}: remote images are not fetched; give a local "
                    "path (relative to the JSONL file) or a data:image/...;base64, URL"
                )
            pieces.append(marker_text)
            urls.append((url, where))
        messages.append({**message, "content": "".join(pieces)})
    return {**record, "messages": messages}, urls


class ImageChatEncoder:
    """A `DocumentEncoder` (axplug.input) wrapping a chat encoder (`axplug_chat.ChatEncoder`):
    each image part becomes the image marker's text, then the model's image sequence; those
    tokens are user content, so the loss mask is 0 on them whatever the chat's `train_on`."""

    field = "*"

    def __init__(self, chat: Any, run_dir: str):
        self.chat, self.run_dir = chat, os.path.abspath(run_dir)
        self.model, _ = image_model(run_dir)
        pixel_width(self.model)  # refused now, not after the tokenizing

    def settings(self) -> dict:
        images = {"model": self.run_dir, "image_token_id": self.model.image_token_id}
        return {**self.chat.settings(), "images": images}

    def meta(self) -> dict:
        return {**self.chat.meta(), "images": {"model": self.run_dir}}

    def files(self) -> dict[str, str]:
        return self.chat.files()

    def encode(self, tokenizer: Any, record: Any) -> list[tuple[list[int], list[int]]]:
        marker = image_marker(self.model)
        text = tokenizer.decode([marker])
        if tokenizer.encode(text) != [marker]:
            raise ConfigValueError(
                f"the tokenizer does not read the image marker (token {marker}, {text!r}) back "
                "as that one token; prepare with the model's tokenizer"
            )
        joined, urls = joined_parts(record, text)
        image = expand_images([marker], self.model, tokenizer)
        out = []
        for ids, mask in self.chat.encode(tokenizer, joined):
            if ids.count(marker) != len(urls):
                raise ConfigValueError(
                    f"the conversation holds the image marker {text!r} {ids.count(marker)} "
                    f"time(s) for {len(urls)} image part(s); a text part may not contain it"
                )
            expanded: list[int] = []
            masked: list[int] = []
            for token, trained in zip(ids, mask, strict=True):
                expanded += image if token == marker else [token]
                masked += [0] * len(image) if token == marker else [trained]
            out.append((expanded, masked))
        return out


def _records(sources: list[str]) -> Iterator[tuple[str, str, Any]]:
    """(source, what names the record: `FILE record N`, the record) of every record of
    `sources`, in prepare-data's order."""
    from axplug.api.data import read_documents

    for source in sources:
        for number, record in enumerate(read_documents(source, field="*"), 1):
            yield source, f"{source} record {number}", record


def _local(url: str, source: str) -> str:
    """`url`, a relative path resolved against the directory of the file that names it."""
    if urlsplit(url).scheme or os.path.isabs(url):
        return url
    return os.path.join(os.path.dirname(source), url)


def _document_pixels(tokens: np.ndarray, pixels: np.ndarray, model: Any, what: str) -> np.ndarray:
    """[tokens, width] float32: each image's pixels (`pixels` [images, ...]) flattened and
    split over its placeholder tokens, as `VisionLanguageModel.pixels_from_tokens` reads
    them; zeros elsewhere."""
    per_image = VisionLanguageModel.fixed_tokens_per_image(model)
    where = np.flatnonzero(tokens == model.image_token_id)
    if len(where) != len(pixels) * per_image:
        raise ConfigError(
            f"{what}: its document has {len(where)} image placeholder tokens for {len(pixels)} "
            f"image(s) of {per_image}: the data directory was prepared from other records; "
            "prepare it again into a new --output directory"
        )
    out = np.zeros((len(tokens), pixel_width(model)), np.float32)
    out[where] = np.reshape(pixels, (len(where), out.shape[1]))
    return out


def _pixels(urls: list[tuple[str, str]], source: str, what: str, model: Any,
            directories: list[str]) -> np.ndarray:  # fmt: skip
    """[images, channels, height, width] of a record's image `urls`, through the processor."""
    from axplug_vision.images import load_image

    images = []
    for url, where in urls:
        try:
            images.append(load_image(_local(url, source), allow_files=True))
        except ConfigError as e:
            raise ConfigError(f"{what}: {where}: {e}") from None
    if not images:
        return np.zeros((0,), np.float32)
    pixels = image_pixels(images, directories, model)
    if len(pixels) != len(images):
        raise ConfigError(
            f"{what}: the image processor made {len(pixels)} images of its {len(images)} "
            "(crops); prepared data holds one per image part: switch the cropping off"
        )
    return pixels


def store_image_pixels(data_dir: str) -> dict:
    """Writes the `image_pixels` token values of a data directory prepared with an
    `ImageChatEncoder` (meta.json names its model), from the images of its source records;
    returns its meta.json content. meta.json is absent until they are all written."""
    from axplug.api.checkpoint import atomic_file, write_text
    from axplug.api.data import open_shards, read_meta

    root = pathlib.Path(data_dir)
    meta = read_meta(root)
    if not isinstance(meta.get("images"), dict):
        raise ConfigError(f"{data_dir}: not image-chat data (`axplug prepare-chat --images`)")
    model, directories = image_model(meta["images"]["model"])
    records = _records([s["path"] for s in meta["settings"]["sources"]])
    shards = open_shards(root, meta)
    (root / "meta.json").unlink()
    for shard in shards:  # one document per record, in the records' order
        with atomic_file(shard.path.with_name(f"{shard.path.stem}.{IMAGE_VALUES}.bin")) as f:
            for start, end in zip(shard.docs[:-1], shard.docs[1:], strict=True):
                source, what, record = next(records)
                _, urls = joined_parts(record, "")
                pixels = _pixels(urls, source, what, model, directories)
                tokens = np.asarray(shard.tokens[start:end])
                _document_pixels(tokens, pixels, model, what).tofile(f)
    entry = {"dtype": "float32", "width": pixel_width(model), "aligned": "inputs"}
    meta["token_values"] = {IMAGE_VALUES: entry}
    write_text(root / "meta.json", json.dumps(meta, indent=1) + "\n")
    return meta
