"""Loading a request's image from a base64 data URL or, when allowed, a local file, in limits."""

from __future__ import annotations

import base64
import binascii
import io
import os
import warnings
from urllib.parse import urlsplit
from urllib.request import url2pathname

from PIL import Image

from axplug.api.config import ConfigError

__all__ = ["load_image"]

MAX_BYTES = 20 * 2**20
MAX_PIXELS = 50_000_000


def load_image(
    source: str,
    *,
    allow_files: bool = False,
    max_bytes: int = MAX_BYTES,
    max_pixels: int = MAX_PIXELS,
) -> Image.Image:
    """The decoded image (mode kept) of a `data:image/...;base64,` URL or, with `allow_files`, a
    local path or `file://` URL; remote URLs are refused, never fetched."""
    scheme = urlsplit(source).scheme.lower()
    if scheme == "data":
        data = _data_url_bytes(source, max_bytes)
    elif scheme in ("", "file"):
        data = _file_bytes(source, allow_files, max_bytes)
    else:
        raise ConfigError(
            f"image {_short(source)}: {scheme}:// images are not fetched; send the image inline "
            "as a data:image/...;base64, URL"
        )
    return _decode(data, max_pixels)


def _data_url_bytes(url: str, max_bytes: int) -> bytes:
    header, comma, payload = url.partition(",")
    media = header[len("data:") :].lower()
    if not comma or not media.startswith("image/") or not media.endswith(";base64"):
        raise ConfigError(
            f"image {_short(url)}: a data URL must read data:image/<type>;base64,<payload>"
        )
    # Checked before decoding so that a huge payload costs no memory: 4 characters per 3 bytes.
    if len(payload) > 4 * (max_bytes // 3 + 1):
        raise ConfigError(
            f"image data URL: {len(payload)} base64 characters decode to more than "
            f"max_bytes={max_bytes} bytes"
        )
    try:
        data = base64.b64decode(payload, validate=True)
    except binascii.Error as e:
        raise ConfigError(f"image data URL: the payload is not valid base64 ({e})") from e
    _check_bytes(len(data), max_bytes, "data URL")
    return data


def _file_bytes(source: str, allow_files: bool, max_bytes: int) -> bytes:
    parts = urlsplit(source)
    if parts.scheme.lower() == "file":
        if parts.netloc not in ("", "localhost"):
            raise ConfigError(f"image {source}: file URLs on another host are not read")
        path = url2pathname(parts.path)
    else:
        path = source
    if not allow_files:
        raise ConfigError(
            f"image {_short(source)}: local files are not read here (allow_files=False); send the "
            "image as a data:image/...;base64, URL"
        )
    try:
        with open(path, "rb") as file:
            _check_bytes(os.fstat(file.fileno()).st_size, max_bytes, path)
            data = file.read(max_bytes + 1)
    except OSError as e:
        raise ConfigError(f"image {path}: cannot be read ({e.strerror or e})") from e
    _check_bytes(len(data), max_bytes, path)  # a file that grew since its size was read
    return data


def _decode(data: bytes, max_pixels: int) -> Image.Image:
    try:
        with warnings.catch_warnings():
            # Pillow's own bomb limit warns below ours; `max_pixels` is the limit that counts here.
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(data))
            width, height = image.size
            if width * height > max_pixels:
                raise ConfigError(
                    f"image: {width}x{height} = {width * height} pixels, more than "
                    f"max_pixels={max_pixels}"
                )
            image.load()
    except Image.DecompressionBombError as e:
        raise ConfigError(
            f"image: more pixels than Pillow decodes safely ({e}); the limit is "
            f"max_pixels={max_pixels}"
        ) from e
    except (Image.UnidentifiedImageError, OSError, SyntaxError, ValueError) as e:
        raise ConfigError(f"image: the payload is not a decodable image ({e})") from e
    return image


def _check_bytes(size: int, max_bytes: int, what: str) -> None:
    if size > max_bytes:
        raise ConfigError(f"image {what}: {size} bytes, more than max_bytes={max_bytes}")


def _short(source: str) -> str:
    return source if len(source) <= 80 else source[:77] + "..."
