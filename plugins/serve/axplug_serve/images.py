"""Images in chat messages: OpenAI's `image_url` parts, checked against the server's limits and
made into a prompt's image tokens and features by the model's own hook (`prompt_with_images`,
as `axplug generate --image` does)."""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import Sequence
from typing import Any
from urllib.parse import urlsplit

from axplug.api.config import ConfigError, UsageError

__all__ = [
    "ImagePrompts",
    "add_image_arguments",
    "check_image_options",
    "content_images",
    "content_parts",
    "content_text",
    "image_prompts",
]

MAX_IMAGES = 8
MAX_IMAGE_BYTES = 20 * 2**20
MAX_IMAGE_PIXELS = 25_000_000  # a 6000x4000 photograph; 100 MB once decoded to RGBA


def content_parts(content: str | list[dict[str, Any]] | None) -> str | list[dict] | None:
    """A message's content checked: its text, or, when it holds images, its parts in order
    (`{"text": str}` or `{"image": URL}`)."""
    if content is None or isinstance(content, str):
        return content
    parts = [_part(i, part) for i, part in enumerate(content)]
    if all("text" in part for part in parts):
        return "".join(part["text"] for part in parts)
    return parts


def _part(index: int, part: dict[str, Any]) -> dict[str, str]:
    kind = part.get("type")
    if kind == "text" and isinstance(part.get("text"), str):
        return {"text": part["text"]}
    if kind == "image_url":
        url = part.get("image_url")
        url = url.get("url") if isinstance(url, dict) else url  # {"url": ...} or the URL itself
        if isinstance(url, str) and url:
            return {"image": url}
        raise ValueError(f"part {index}: an image_url part reads {{'url': 'data:image/...'}}")
    raise ValueError(
        f"part {index}: a content part is {{'type': 'text', 'text': ...}} or {{'type': "
        f"'image_url', 'image_url': {{'url': ...}}}}, got type {str(kind)[:32]!r}"
    )


def content_text(content: str | list[dict] | None, image_text: str) -> str | None:
    """The content a chat template renders: its text, each image as `image_text`."""
    if content is None or isinstance(content, str):
        return content
    return "".join(part.get("text", image_text) for part in content)


def content_images(content: str | list[dict] | None) -> list[str]:
    """The URLs of the content's images, in order."""
    if not isinstance(content, list):
        return []
    return [part["image"] for part in content if "image" in part]


class ImagePrompts:
    """The served model's image hook under the server's limits: a prompt's image markers
    (`marker_text` in the rendered messages) become its image tokens and their features."""

    def __init__(self, model: Any, params: Any, tokenizer: Any, directories: Sequence[str], *,
                 max_images: int, max_bytes: int, max_pixels: int, allow_files: bool):  # fmt: skip
        self._hook, self._params = model.prompt_with_images, params
        self._tokenizer, self._directories = tokenizer, list(directories)
        self.max_images, self.allow_files = max_images, allow_files
        self._limits = {"max_bytes": max_bytes, "max_pixels": max_pixels}
        self._marker_text, self._marker_problem = None, "it has no image_marker_text"
        try:
            if hasattr(model, "image_marker_text"):
                self._marker_text = model.image_marker_text(tokenizer)
        except ConfigError as exc:  # text requests still work; an image one gets this
            self._marker_problem = str(exc)

    @property
    def marker_text(self) -> str:
        """The text of one image in a rendered prompt; ConfigError when there is none."""
        if self._marker_text is None:
            raise ConfigError(f"this model cannot take images in chat messages: "
                              f"{self._marker_problem}")  # fmt: skip
        return self._marker_text

    def _check(self, urls: Sequence[str]) -> None:
        """ConfigError for more images than allowed, or a local file without the flag."""
        if len(urls) > self.max_images:
            raise ConfigError(
                f"{len(urls)} images in one request; this server takes at most "
                f"{self.max_images} (--max-images-per-request)"
            )
        for url in urls:
            if not self.allow_files and urlsplit(url).scheme.lower() in ("", "file"):
                raise ConfigError(
                    f"image {url[:80]!r}: local files are not read by this server (it runs "
                    "without --allow-local-images); send the image as a data:image/...;base64, URL"
                )

    async def prompt(self, ids: list[int], urls: Sequence[str]) -> tuple[list[int], Any]:
        """(the expanded ids, `Request.embeddings`) of encoded `ids` whose image markers take
        `urls` in order; decoding and the vision tower run off the event loop."""
        self._check(urls)
        return await asyncio.to_thread(
            self._hook, self._params, ids, list(urls), tokenizer=self._tokenizer,
            directories=self._directories, allow_files=self.allow_files, **self._limits,
        )  # fmt: skip


def add_image_arguments(parser: argparse.ArgumentParser) -> None:
    """`axplug serve`'s limits on images in chat messages (vision-language models)."""
    group = parser.add_argument_group(
        "images", "image_url parts of chat messages, for a vision-language model; the body "
        "they come in is also limited by --max-body-bytes"
    )  # fmt: skip
    group.add_argument(
        "--max-images-per-request", type=int, default=MAX_IMAGES, metavar="N",
        help=f"images in one request's messages ({MAX_IMAGES}; 0: none)",
    )  # fmt: skip
    group.add_argument(
        "--max-image-bytes", type=int, default=MAX_IMAGE_BYTES, metavar="N",
        help="encoded bytes of one image (20 MiB)",
    )  # fmt: skip
    group.add_argument(
        "--max-image-pixels", type=int, default=MAX_IMAGE_PIXELS, metavar="N",
        help=f"width x height of one image, checked before it is decoded ({MAX_IMAGE_PIXELS})",
    )  # fmt: skip
    group.add_argument(
        "--allow-local-images", action="store_true",
        help="read images given as a path or file:// URL on the server's machine (default: "
        "only data: URLs; http(s) URLs are never fetched)",
    )  # fmt: skip


def check_image_options(args: argparse.Namespace) -> None:
    """UsageError naming the first image limit out of its range."""
    for option, value, low in (("--max-images-per-request", args.max_images_per_request, 0),
                               ("--max-image-bytes", args.max_image_bytes, 1),
                               ("--max-image-pixels", args.max_image_pixels, 1)):  # fmt: skip
        if value < low:
            raise UsageError(f"{option} {value}: must be at least {low}")


def image_prompts(loaded: Any, tokenizer: Any, args: argparse.Namespace) -> ImagePrompts | None:
    """The image hook of `loaded`'s model under `args`' limits; None for a text-only model."""
    if getattr(loaded.model, "prompt_with_images", None) is None:
        return None
    return ImagePrompts(
        loaded.model, loaded.params, tokenizer, [d for d, _ in loaded.lineage],
        max_images=args.max_images_per_request, max_bytes=args.max_image_bytes,
        max_pixels=args.max_image_pixels, allow_files=args.allow_local_images,
    )  # fmt: skip
