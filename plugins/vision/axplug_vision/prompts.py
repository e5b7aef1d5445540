"""Prompts with images: each image marker token becomes the model's image sequence, whose
placeholders take the image's features (`Request.embeddings`)."""

from __future__ import annotations

import os
import weakref
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from axplug.api.config import ConfigError
from axplug.api.layers import functional

__all__ = [
    "image_marker",
    "image_marker_text",
    "expand_images",
    "image_pixels",
    "image_embeddings",
    "rotary_embeddings",
    "prompt_with_images",
]

_ENCODERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def image_marker(cfg: Any) -> int:
    """The token that stands for one image in a rendered prompt: the begin-of-image token
    where the model marks images so (Gemma 3), else the placeholder itself (LLaVA, Qwen)."""
    return cfg.image_begin_id if cfg.image_marked_by_begin else cfg.image_token_id


def marked_image(cfg: Any) -> list[int]:
    """The tokens that stand for one image in a prompt: its marker, between the begin and end
    tokens where the model has them but marks images by the placeholder (Qwen2.5-VL's
    <|vision_start|><|image_pad|><|vision_end|>)."""
    marker = image_marker(cfg)
    if cfg.image_begin_id is None or cfg.image_marked_by_begin:
        return [marker]
    return [cfg.image_begin_id, marker, cfg.image_end_id]


def image_marker_text(cfg: Any, tokenizer: Any) -> str:
    """The text that `tokenizer` encodes as one image's marked tokens (LLaVA's "<image>"):
    what a chat message's image becomes before its prompt is encoded."""
    tokens = marked_image(cfg)
    text = tokenizer.decode(tokens)
    if not text or tokenizer.encode(text) != tokens:
        raise ConfigError(
            f"the tokenizer spells the image marker tokens {tokens} as {text!r}, which does "
            "not encode back to those tokens alone; give the model a tokenizer that has them "
            "as added tokens (its Hugging Face tokenizer.json)"
        )
    return text


def expand_images(
    ids: Sequence[int], cfg: Any, tokenizer: Any = None, counts: Sequence[int] | None = None
) -> list[int]:
    """`ids` with each image marker replaced by the model's image sequence: its
    `tokens_per_image` placeholders (the k-th image's `counts[k]` where images differ:
    Qwen2.5-VL's), between the begin and end tokens and the text around them where the
    model has those (Gemma 3: "\\n\\n<start_of_image>...<end_of_image>\\n\\n")."""
    from axplug_vision.model import VisionLanguageModel

    if cfg.image_text_around and tokenizer is None:
        raise ConfigError(
            f"the model's images have text around them ({cfg.image_text_around!r}), which "
            "needs its tokenizer: give the prompt as text, or --tokenizer"
        )
    around = tokenizer.encode(cfg.image_text_around) if cfg.image_text_around else []
    marker, out, k = image_marker(cfg), list[int](), 0
    for token in ids:
        if token != marker:
            out.append(token)
            continue
        n = counts[k] if counts is not None else VisionLanguageModel.fixed_tokens_per_image(cfg)
        image, k = [cfg.image_token_id] * n, k + 1
        if cfg.image_marked_by_begin:
            image = [*around, cfg.image_begin_id, *image, cfg.image_end_id, *around]
        out += image
    return out


def image_pixels(images: Sequence[Any], directories: Sequence[str], cfg: Any) -> np.ndarray:
    """[images, channels, height, width]: `images` (PIL images) through the processor of the
    first of `directories` with a preprocessor_config.json, checked against the tower."""
    pixels = _processor(directories)(list(images))["pixel_values"]
    tower = cfg.vision
    want = (tower.num_channels, tower.image_size, tower.image_size)
    if tuple(pixels.shape[1:]) != want:
        raise ConfigError(
            f"the model's preprocessor_config.json makes images of {list(pixels.shape[1:])}, "
            f"but its tower takes {list(want)}"
        )
    return pixels


def _processor(directories: Sequence[str]) -> Any:
    """The image processor of the first of `directories` with its settings."""
    from axplug_vision.preprocess import image_processor, read_preprocessor_config

    home = next((d for d in directories if _has_processor(d)), None)
    if home is None:
        raise ConfigError(
            f"no preprocessor_config.json in {', '.join(directories)}: images need the "
            "model's image processor settings (import the model from a Hugging Face "
            "checkpoint that has them, or copy the file beside the run's tokenizer)"
        )
    return image_processor(read_preprocessor_config(home))


def _has_processor(directory: str) -> bool:
    names = ("preprocessor_config.json", "processor_config.json")
    return any(os.path.isfile(os.path.join(directory, n)) for n in names)


def _encoder(model: Any):
    """`model.encode_images(pixels, **vision_inputs)` jitted, once per model."""
    if model not in _ENCODERS:

        def encode(params, pixels, vision_inputs):
            inputs = {"pixels": pixels, **vision_inputs}
            return functional(model, prng_key=None, state=params, inputs=inputs,
                              is_training=False, method="encode_images")[0]  # fmt: skip

        _ENCODERS[model] = jax.jit(encode)
    return _ENCODERS[model]


def rotary_embeddings(cfg: Any, ids: Sequence[int], grids: Any, features: Any) -> tuple:
    """`Request.embeddings` of a prompt of a model with multimodal rotary positions (Qwen2.5-VL):
    every token from its first image on carries [its features (an image token's) or zeros,
    its (time, height, width) positions, the offset of the text positions after it from
    their indices, whether it is an image's] (`VisionLanguageModel.Config.rope_axes`), so
    any prefill of the prompt past its first image, after a prefix-cache hit too, finds its
    positions in what it feeds."""
    from axplug_vision.qwen_rope import rope_index

    positions, _ = rope_index(ids, grids, cfg)
    image = np.asarray(ids) == cfg.image_token_id
    where = np.arange(int(np.argmax(image)), len(ids))
    features = np.asarray(features, np.float32).reshape(-1, np.shape(features)[-1])
    after = (positions[:, 0] - np.arange(len(ids))).astype(np.float32)  # text's own offset
    # An image's tokens: the offset of the text after it, which continues from the image's
    # largest position + 1.
    placeholders = np.flatnonzero(image)
    ends = np.flatnonzero(np.diff(np.append(placeholders, -2)) != 1)
    for first, last in zip(np.append(0, ends[:-1] + 1), ends, strict=True):
        run = placeholders[first : last + 1]
        after[run] = positions[run].max() + 1 - (run[-1] + 1)
    vectors = np.zeros((len(where), features.shape[-1]), np.float32)
    vectors[image[where]] = features
    carried = [vectors, positions[where], after[where, None], image[where, None]]
    return where, np.concatenate(carried, axis=1).astype(np.float32)


def image_embeddings(model: Any, params: Any, ids: Sequence[int], pixels: Any) -> tuple:
    """`Request.embeddings` of expanded prompt `ids` with images `pixels` [images, channels,
    height, width]: (its placeholder indices, the images' features, in order)."""
    cfg = model.config
    where = np.flatnonzero(np.asarray(ids) == cfg.image_token_id)
    features = np.asarray(_encoder(model)(params, np.asarray(pixels, np.float32), {}))
    vectors = features.reshape(-1, features.shape[-1])
    if len(where) != len(vectors):
        raise ConfigError(
            f"the prompt has {len(where)} image placeholder tokens (id {cfg.image_token_id}), "
            f"but its {len(pixels)} image(s) give {len(vectors)} features; give one "
            "placeholder per image feature"
        )
    return where, vectors


def prompt_with_images(
    model: Any,
    params: Any,
    ids: Sequence[int],
    images: Sequence[Any],
    *,
    tokenizer: Any = None,
    directories: Sequence[str] = (),
    allow_files: bool = False,
    max_bytes: int = 20 * 2**20,
    max_pixels: int = 50_000_000,
) -> tuple[list[int], tuple[np.ndarray, np.ndarray] | None]:
    """(the expanded prompt, its `Request.embeddings`) of token `ids` with `images` (data
    URLs, local paths where `allow_files`, or PIL images): one image marker per image (none:
    one marker per image is put before the prompt), features from the model's tower."""
    from axplug_vision.images import load_image

    cfg, marker = model.config, image_marker(model.config)
    loaded = [
        image if hasattr(image, "size") else load_image(
            image, allow_files=allow_files, max_bytes=max_bytes, max_pixels=max_pixels
        )
        for image in images
    ]  # fmt: skip
    markers = sum(1 for t in ids if t == marker)
    if markers == 0:
        ids = marked_image(cfg) * len(loaded) + list(ids)
    elif markers != len(loaded):
        raise ConfigError(
            f"the prompt has {markers} image marker(s) (token {marker}) for {len(loaded)} "
            "image(s); give one per image, or none to put them all before the prompt"
        )
    if not loaded:
        return list(ids), None
    if cfg.rope_axes:  # images of their own sizes, as patches laid out by their grids
        from axplug_vision.qwen_tower import qwen_vision_inputs

        processed = _processor(directories)(loaded)
        grids = processed["image_grid_thw"]
        counts = [int(np.prod(g)) // cfg.vision.spatial_merge_size**2 for g in grids]
        expanded = expand_images(ids, cfg, tokenizer, counts)
        inputs = qwen_vision_inputs(grids, cfg.vision)
        features = _encoder(model)(params, processed["pixel_values"], inputs)
        return expanded, rotary_embeddings(cfg, expanded, grids, features)
    expanded = expand_images(ids, cfg, tokenizer)
    pixels = image_pixels(loaded, directories, cfg)
    return expanded, image_embeddings(model, params, expanded, pixels)
