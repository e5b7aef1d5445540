"""Hugging Face image processors (CLIP's, SigLIP's, Gemma 3's, Qwen2-VL's) in numpy and Pillow.

These reproduce transformers' PIL backend (`CLIPImageProcessorPil`, ...): without torchvision,
`AutoImageProcessor` returns it for every spelling of these types (plain, `...Fast`, `...Pil`).
It resizes uint8 images with Pillow, so the same Pillow calls and float steps here give the same
bits. The torchvision backend, used where torchvision is installed, resizes with torch's kernels
(other weights and rounding) and is not matched.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from axplug.api.config import ConfigError

__all__ = ["PROCESSORS", "image_processor", "read_preprocessor_config", "smart_resize"]

OPENAI_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
HALF = (0.5, 0.5, 0.5)


def read_preprocessor_config(directory: str | Path) -> dict:
    """The image processor's settings of a Hugging Face model directory: as transformers, the
    `image_processor` of `processor_config.json` when there, else `preprocessor_config.json`."""
    nested = _read_json(Path(directory) / "processor_config.json", required=False)
    if isinstance(nested.get("image_processor"), dict):
        return nested["image_processor"]
    return _read_json(Path(directory) / "preprocessor_config.json", required=True)


def _read_json(path: Path, required: bool) -> dict:
    if not path.is_file():
        if required:
            raise ConfigError(f"{path}: no such file; the model directory needs its image settings")
        return {}
    try:
        config = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"{path}: not readable JSON ({e})") from e
    if not isinstance(config, dict):
        raise ConfigError(f"{path}: holds a {type(config).__name__}, not a JSON object")
    return config


def image_processor(config: dict) -> Any:
    """The processor of a `preprocessor_config.json` dict, picked by its `image_processor_type`;
    calling it on a list of PIL images gives a dict of numpy arrays (`pixel_values`, ...)."""
    kind = str(config.get("image_processor_type"))
    for suffix in ("Fast", "Pil"):
        kind = kind.removesuffix(suffix)
    if kind not in PROCESSORS:
        raise ConfigError(
            f"image_processor_type={config.get('image_processor_type')!r}: not an image processor "
            f"axplug-vision reads (supported: {', '.join(PROCESSORS)})"
        )
    cls, defaults = PROCESSORS[kind]
    return cls(config, defaults)


def _setting(config: dict, defaults: dict, key: str, needed_by: str | None = None) -> Any:
    """The value of `key`, the class default when absent. As in transformers, null is None (a
    switch off), not the default; a null that `needed_by` needs is an error."""
    value = config[key] if key in config else defaults.get(key)
    if value is None and needed_by:
        raise ConfigError(f"{key} is null (or absent); {needed_by} needs it")
    return value


def _size(value: Any, name: str, default_to_square: bool) -> dict[str, int]:
    """transformers' `get_size_dict`: an int or [h, w] as a size dict, validated."""
    if isinstance(value, int):
        value = {"height": value, "width": value} if default_to_square else {"shortest_edge": value}
    elif isinstance(value, (list, tuple)) and len(value) == 2:
        value = {"height": value[0], "width": value[1]}
    if not isinstance(value, dict) or set(value) not in _SIZE_KEYS:
        raise ConfigError(
            f"{name}={value!r}: axplug-vision reads a size as "
            + " or ".join("{" + ", ".join(sorted(keys)) + "}" for keys in _SIZE_KEYS)
        )
    return value


_SIZE_KEYS = [{"height", "width"}, {"shortest_edge"}, {"shortest_edge", "longest_edge"}]


class ImageProcessor:
    """CLIP's and SigLIP's: to RGB, resize, center crop, rescale, normalize, as `PilBackend`."""

    def __init__(self, config: dict, defaults: dict):
        def get(key: str, needed_by: str | None = None) -> Any:
            return _setting(config, defaults, key, needed_by)

        # Null: transformers skips the conversion and so fails on any image not already RGB
        # (a 3-value mean for 1 or 4 channels); converting gives its values on RGB images and
        # serves the rest (Gemma 3's own config has it null).
        self.do_convert_rgb = get("do_convert_rgb") is not False
        self.do_resize = bool(get("do_resize"))
        if self.do_resize:
            default_to_square = bool(get("default_to_square"))
            self.size = _size(get("size", "do_resize"), "size", default_to_square)
            self.resample = get("resample", "do_resize")
            if self.resample not in range(6):
                raise ConfigError(f"resample={self.resample!r}: not a PIL resampling filter (0-5)")
            self.resample = int(self.resample)
        self.do_center_crop = bool(get("do_center_crop"))
        if self.do_center_crop:
            self.crop_size = _size(get("crop_size", "do_center_crop"), "crop_size", True)
            if set(self.crop_size) != {"height", "width"}:
                raise ConfigError(f"crop_size={self.crop_size}: needs height and width")
        self.do_rescale = bool(get("do_rescale"))
        if self.do_rescale:
            self.rescale_factor = float(get("rescale_factor", "do_rescale"))
        self.do_normalize = bool(get("do_normalize"))
        if self.do_normalize:
            self.image_mean = get("image_mean", "do_normalize")
            self.image_std = get("image_std", "do_normalize")
        if get("do_pad"):
            raise ConfigError("do_pad=true: padding a batch is not read by axplug-vision")

    def __call__(self, images: list[Image.Image]) -> dict[str, np.ndarray]:
        """`pixel_values` [n, channels, height, width] float32 of the images."""
        return {"pixel_values": _stack([self.finish(self.resize(self.rgb(i))) for i in images])}

    def rgb(self, image: Image.Image) -> np.ndarray:
        """The image as a uint8 [height, width, channels] array, alpha composited on white."""
        if self.do_convert_rgb:
            if "A" in image.getbands() or image.info.get("transparency") is not None:
                white = Image.new("RGBA", image.size, (255, 255, 255, 255))
                image = Image.alpha_composite(white, image.convert("RGBA"))
            image = image.convert("RGB")
        array = np.asarray(image)
        if array.dtype != np.uint8:
            raise ConfigError(
                f"do_convert_rgb=false: an image of mode {image.mode!r} is not 8-bit; convert it "
                "or set do_convert_rgb"
            )
        return array[..., None] if array.ndim == 2 else array

    def resize(self, array: np.ndarray) -> np.ndarray:
        """Resized to `size`, then center cropped to `crop_size` when asked."""
        if self.do_resize:
            array = _resize(array, *self.target_size(*array.shape[:2]), self.resample)
        if self.do_center_crop:
            array = _center_crop(array, self.crop_size["height"], self.crop_size["width"])
        return array

    def target_size(self, height: int, width: int) -> tuple[int, int]:
        """`PilBackend.resize`'s output (height, width) for `size`."""
        size = self.size
        if "height" in size:
            return size["height"], size["width"]
        if "longest_edge" in size:
            return _aspect_size(height, width, size["shortest_edge"], size["longest_edge"])
        short, long = sorted((height, width))
        new_short, new_long = size["shortest_edge"], int(size["shortest_edge"] * long / short)
        return (new_long, new_short) if width <= height else (new_short, new_long)

    def finish(self, array: np.ndarray) -> np.ndarray:
        """Rescaled and normalized as [channels, height, width] float32, in transformers' float
        steps (rescale in float64, normalize in float32) so results are bit-identical."""
        pixels = array
        if self.do_rescale:
            pixels = (pixels.astype(np.float64) * self.rescale_factor).astype(np.float32)
        pixels = pixels.astype(np.float32)
        if self.do_normalize:
            channels = pixels.shape[-1]
            mean = _per_channel(self.image_mean, channels, "image_mean")
            std = _per_channel(self.image_std, channels, "image_std")
            pixels = (pixels - mean) / std
        return np.ascontiguousarray(pixels.transpose(2, 0, 1))


def _per_channel(value: Any, channels: int, name: str) -> np.ndarray:
    values = np.asarray(value, np.float32).reshape(-1)
    if values.size == 1:
        values = np.repeat(values, channels)
    if values.size != channels:
        raise ConfigError(f"{name}={value}: {values.size} values for {channels} image channels")
    return values


def _resize(array: np.ndarray, height: int, width: int, resample: int) -> np.ndarray:
    image = Image.fromarray(array[..., 0] if array.shape[-1] == 1 else array)
    resized = np.asarray(image.resize((width, height), resample=resample))
    return resized[..., None] if resized.ndim == 2 else resized


def _center_crop(array: np.ndarray, height: int, width: int) -> np.ndarray:
    """transformers' center crop: the centered window, zero padded where the image is smaller
    (the extra pixel of an odd padding goes before)."""
    for axis, target in ((0, height), (1, width)):
        length = array.shape[axis]
        if length >= target:
            start = (length - target) // 2
            array = array[start : start + target] if axis == 0 else array[:, start : start + target]
        else:
            before = (target - length + 1) // 2
            padding = [(0, 0)] * 3
            padding[axis] = (before, target - length - before)
            array = np.pad(array, padding)
    return array


def _aspect_size(height: int, width: int, size: int, max_size: int) -> tuple[int, int]:
    """transformers' `get_size_with_aspect_ratio`: shortest edge to `size`, longest at most
    `max_size`, truncating."""
    raw_size = None
    short, long = float(min(height, width)), float(max(height, width))
    if long / short * size > max_size:
        raw_size = max_size * short / long
        size = int(round(raw_size))
    if (height <= width and height == size) or (width <= height and width == size):
        return height, width
    scale = raw_size if raw_size is not None else size
    if width < height:
        return int(scale * height / width), size
    return size, int(scale * width / height)


def _nonempty(arrays: list[np.ndarray]) -> list[np.ndarray]:
    if not arrays:
        raise ConfigError("image processor: called with no images")
    return arrays


def _stack(arrays: list[np.ndarray]) -> np.ndarray:
    if len({a.shape for a in arrays}) > 1:
        raise ConfigError(
            f"images resized to different shapes {sorted({a.shape for a in arrays})}: set "
            "do_center_crop with a crop_size, or a size with height and width"
        )
    return np.stack(_nonempty(arrays)).astype(np.float32, copy=False)


class Gemma3ImageProcessor(ImageProcessor):
    """Gemma 3's: no center crop; with `do_pan_and_scan`, each wide or tall image is followed by
    crops of it (`num_crops` per image), all resized to `size`."""

    def __init__(self, config: dict, defaults: dict):
        super().__init__({**config, "do_center_crop": False}, defaults)
        self.pan_and_scan = bool(config.get("do_pan_and_scan"))
        names = ("min_crop_size", "max_num_crops", "min_ratio_to_activate")
        values = [config.get(f"pan_and_scan_{n}") for n in names]
        self.min_crop_size, self.max_num_crops, self.min_ratio = (v or 0 for v in values)
        if self.pan_and_scan and None in values:
            raise ConfigError(
                "do_pan_and_scan=true needs " + ", ".join(f"pan_and_scan_{n}" for n in names)
            )

    def __call__(self, images: list[Image.Image]) -> dict[str, np.ndarray]:
        """`pixel_values` [n + sum(num_crops), channels, height, width] float32 and `num_crops`."""
        pixels, num_crops = [], []
        for image in images:
            array = self.rgb(image)
            crops = self.crops(array) if self.pan_and_scan else []
            num_crops.append(len(crops))
            pixels += [self.finish(self.resize(a)) for a in [array, *crops]]
        return {"pixel_values": _stack(pixels), "num_crops": np.array(num_crops, np.int64)}

    def crops(self, array: np.ndarray) -> list[np.ndarray]:
        """transformers' `pan_and_scan`: up to `max_num_crops` equal crops along the long side."""
        height, width = array.shape[:2]
        long, short = max(height, width), min(height, width)
        if long / short < self.min_ratio:
            return []
        count = min(int(math.floor(long / self.min_crop_size)), int(math.floor(long / short + 0.5)))
        count = min(self.max_num_crops, max(2, count))
        crop_h, crop_w = (height, math.ceil(width / count))
        if width < height:
            crop_h, crop_w = math.ceil(height / count), width
        if min(crop_h, crop_w) < self.min_crop_size:
            return []
        if width < height:
            return [array[i * crop_h : (i + 1) * crop_h] for i in range(count)]
        return [array[:, i * crop_w : (i + 1) * crop_w] for i in range(count)]


class Qwen2VLImageProcessor(ImageProcessor):
    """Qwen2-VL's: resize to a multiple of `patch_size * merge_size` near the image's own size
    (`smart_resize`), then the flattened patches in merge-window order and each image's grid."""

    def __init__(self, config: dict, defaults: dict):
        size = config.get("size") or defaults["size"]  # null too: Qwen's own __init__ does so
        if not isinstance(size, dict):
            raise ConfigError(f"size={size!r}: Qwen2-VL needs {{shortest_edge, longest_edge}}")
        size = dict(size)
        # Top-level min_pixels/max_pixels (older configs) override `size`, as in transformers.
        for key, edge in (("min_pixels", "shortest_edge"), ("max_pixels", "longest_edge")):
            if config.get(key) is not None:
                size[edge] = config[key]
                size.pop(key, None)
        super().__init__({**config, "size": size, "do_center_crop": False}, defaults)
        if self.do_resize and set(self.size) != {"shortest_edge", "longest_edge"}:
            raise ConfigError(
                f"size={self.size}: Qwen2-VL needs shortest_edge and longest_edge (pixel counts)"
            )
        self.patch_size, self.temporal_patch_size, self.merge_size = (
            int(_setting(config, defaults, k, "Qwen2-VL"))
            for k in ("patch_size", "temporal_patch_size", "merge_size")
        )

    def target_size(self, height: int, width: int) -> tuple[int, int]:
        """`smart_resize` to the merge-window factor within the pixel budget."""
        return smart_resize(
            height,
            width,
            self.patch_size * self.merge_size,
            self.size["shortest_edge"],
            self.size["longest_edge"],
        )

    def __call__(self, images: list[Image.Image]) -> dict[str, np.ndarray]:
        """`pixel_values` [sum(t*h*w), channels*temporal_patch*patch*patch] float32 and
        `image_grid_thw` [n, 3] int64."""
        patches, grids = [], []
        for image in images:
            pixels = self.finish(self.resize(self.rgb(image)))
            patches.append(self.patchify(pixels))
            grids.append([1, *(n // self.patch_size for n in pixels.shape[1:])])
        return {
            "pixel_values": np.concatenate(_nonempty(patches)).astype(np.float32, copy=False),
            "image_grid_thw": np.array(grids, np.int64),
        }

    def patchify(self, pixels: np.ndarray) -> np.ndarray:
        """[channels, height, width] as rows of a patch repeated over `temporal_patch_size`
        (a still image is one temporal step), ordered by merge window then row-major in it."""
        channels, height, width = pixels.shape
        patch, merge = self.patch_size, self.merge_size
        if height % (patch * merge) or width % (patch * merge):
            raise ConfigError(
                f"image of {height}x{width} is not a multiple of patch_size*merge_size="
                f"{patch * merge}; set do_resize"
            )
        grid_h, grid_w = height // patch, width // patch
        windows = pixels.reshape(
            channels, grid_h // merge, merge, patch, grid_w // merge, merge, patch
        ).transpose(1, 4, 2, 5, 0, 3, 6)  # [window h, window w, h in it, w in it, c, ph, pw]
        repeated = np.broadcast_to(
            windows[:, :, :, :, :, None],
            (*windows.shape[:5], self.temporal_patch_size, patch, patch),
        )
        return repeated.reshape(grid_h * grid_w, -1)


def smart_resize(
    height: int, width: int, factor: int, min_pixels: int, max_pixels: int
) -> tuple[int, int]:
    """Qwen2-VL's target size: multiples of `factor`, about the image's own pixel count clamped to
    [min_pixels, max_pixels], aspect ratio kept (Python's half-to-even `round`, as transformers)."""
    if max(height, width) / min(height, width) > 200:
        raise ConfigError(
            f"image of {height}x{width}: Qwen2-VL needs an aspect ratio of at most 200"
        )
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


_COMMON = dict(
    do_convert_rgb=True, do_resize=True, do_rescale=True, rescale_factor=1 / 255,
    do_normalize=True, default_to_square=False, resample=3,
    image_mean=OPENAI_CLIP_MEAN, image_std=OPENAI_CLIP_STD,
)  # fmt: skip
_SQUARE = dict(size={"height": 224, "width": 224}, image_mean=HALF, image_std=HALF)

# image_processor_type -> (class, transformers' class defaults for settings a config leaves out)
PROCESSORS: dict[str, tuple[type[ImageProcessor], dict]] = {
    "CLIPImageProcessor": (ImageProcessor, dict(
        _COMMON, size={"shortest_edge": 224}, do_center_crop=True,
        crop_size={"height": 224, "width": 224},
    )),
    "SiglipImageProcessor": (ImageProcessor, dict(_COMMON, **_SQUARE)),
    "Gemma3ImageProcessor": (
        Gemma3ImageProcessor, dict(_COMMON, **_SQUARE, resample=2, default_to_square=True)
    ),
    "Qwen2VLImageProcessor": (Qwen2VLImageProcessor, dict(
        _COMMON, size={"shortest_edge": 56 * 56, "longest_edge": 28 * 28 * 1280},
        patch_size=14, temporal_patch_size=2, merge_size=2,
    )),
}  # fmt: skip
