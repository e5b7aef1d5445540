"""Image preprocessing against transformers' image processors (its PIL backend, the one it uses
without torchvision) on decoded PNGs of several sizes and modes, and the safe image loader."""

import base64
import io
import json
import struct
import warnings
import zlib

import numpy as np
import pytest
from PIL import Image

transformers = pytest.importorskip("transformers")

from axplug_vision.images import load_image
from axplug_vision.preprocess import image_processor, read_preprocessor_config

from axplug.api.config import ConfigError


def png_bytes(image):
    buffer = io.BytesIO()
    image.save(buffer, "PNG")
    return buffer.getvalue()


def decoded_png(width, height, mode, seed=0):
    """A smooth gradient plus noise, through a PNG file and back (a real decoded image)."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    smooth = np.stack([x / width, y / height, (x + y) / (width + height)], -1) * 200
    rgb = np.clip(smooth + rng.normal(0, 25, smooth.shape), 0, 255).astype(np.uint8)
    image = Image.fromarray(rgb, "RGB")
    if mode == "RGBA":
        alpha = np.clip(x / width * 255 + rng.normal(0, 30, x.shape), 0, 255).astype(np.uint8)
        image = Image.fromarray(np.dstack([rgb, alpha]), "RGBA")
    elif mode == "P":  # a palette with a transparent entry: composited on white too
        image = image.quantize(16)
        image.info["transparency"] = 0
    elif mode != "RGB":
        image = image.convert(mode)
    return Image.open(io.BytesIO(png_bytes(image)))


@pytest.fixture(scope="module")
def images():
    sizes = [(97, 71, "RGB"), (64, 80, "RGBA"), (50, 50, "L"), (40, 30, "P")]
    sizes += [(900, 60, "RGB"), (20, 13, "RGB")]  # very wide; smaller than every target
    return [decoded_png(w, h, mode, seed) for seed, (w, h, mode) in enumerate(sizes)]


CONFIGS = {
    "clip": {
        "image_processor_type": "CLIPImageProcessor",
        "size": {"shortest_edge": 40},
        "crop_size": {"height": 32, "width": 36},
    },
    # Null switches a step off (it is not the class default), as in transformers.
    "clip-nulls": {
        "image_processor_type": "CLIPImageProcessorFast",
        "size": {"height": 30, "width": 20},
        "do_center_crop": None,
        "do_normalize": None,
        "resample": 2,
    },
    "siglip": {
        "image_processor_type": "SiglipImageProcessor",
        "size": {"height": 32, "width": 48},
        "image_mean": [0.5, 0.4, 0.3],
        "image_std": [0.2, 0.3, 0.4],
    },
    "gemma3": {"image_processor_type": "Gemma3ImageProcessor", "size": {"height": 40, "width": 40}},
    "gemma3-pan-and-scan": {
        "image_processor_type": "Gemma3ImageProcessor",
        "size": {"height": 40, "width": 40},
        "do_pan_and_scan": True,
        "pan_and_scan_min_crop_size": 16,
        "pan_and_scan_max_num_crops": 4,
        "pan_and_scan_min_ratio_to_activate": 1.2,
    },
    "qwen2vl": {
        "image_processor_type": "Qwen2VLImageProcessor",
        "min_pixels": 16 * 16 * 4,
        "max_pixels": 64 * 64,
        "patch_size": 8,
        "merge_size": 2,
    },
    # Top-level max_pixels overrides size's longest_edge; an odd temporal patch and merge size.
    "qwen2vl-size": {
        "image_processor_type": "Qwen2VLImageProcessorPil",
        "size": {"shortest_edge": 1000, "longest_edge": 99999},
        "max_pixels": 2500,
        "patch_size": 4,
        "merge_size": 3,
        "temporal_patch_size": 3,
    },
}


def reference_processor(config, tmp_path):
    """transformers' processor of the config as read from a model directory."""
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(config))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return transformers.AutoImageProcessor.from_pretrained(tmp_path, backend="pil")


@pytest.mark.parametrize("name", list(CONFIGS))
def test_pixel_values_equal_transformers(name, images, tmp_path):
    reference = reference_processor(CONFIGS[name], tmp_path)
    expected = reference(images, return_tensors="np")
    got = image_processor(read_preprocessor_config(tmp_path))(images)
    assert set(got) == set(expected) and got["pixel_values"].dtype == np.float32
    for key, value in got.items():
        assert value.shape == expected[key].shape, key
        np.testing.assert_allclose(value, expected[key], rtol=0, atol=1e-5, err_msg=key)
    if name == "gemma3-pan-and-scan":
        assert got["num_crops"].tolist() == [2, 2, 0, 2, 4, 0]  # cut when not about square


def test_a_null_do_convert_rgb_still_converts(images, tmp_path):
    """Gemma 3's config has do_convert_rgb null: transformers then skips the conversion and
    fails on a grayscale image (3-value mean, 1 channel); here it is converted."""
    config = {**CONFIGS["gemma3"], "do_convert_rgb": None}
    reference = reference_processor(config, tmp_path)
    got = image_processor(config)(images)["pixel_values"]
    rgb = [0, 4, 5]
    expected = reference([images[i] for i in rgb], return_tensors="np")["pixel_values"]
    np.testing.assert_allclose(got[rgb], expected, rtol=0, atol=1e-5)
    converted = image_processor(CONFIGS["gemma3"])([images[2]])["pixel_values"]
    np.testing.assert_array_equal(got[2], converted[0])
    with pytest.raises(ValueError, match="mean must have 1 elements"):
        reference([images[2]])


def test_bad_processor_configs_are_errors(tmp_path):
    with pytest.raises(ConfigError, match="'ViTImageProcessor': not an image processor.*Qwen2VL"):
        image_processor({"image_processor_type": "ViTImageProcessor"})
    with pytest.raises(ConfigError, match="size is null .*do_resize needs it"):
        image_processor({"image_processor_type": "SiglipImageProcessor", "size": None})
    with pytest.raises(ConfigError, match="patch_size is null"):
        image_processor({"image_processor_type": "Qwen2VLImageProcessor", "patch_size": None})
    with pytest.raises(ConfigError, match="preprocessor_config.json: no such file"):
        read_preprocessor_config(tmp_path)
    (tmp_path / "preprocessor_config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="preprocessor_config.json: not readable JSON"):
        read_preprocessor_config(tmp_path)
    nested = {"image_processor": {"image_processor_type": "SiglipImageProcessor"}}
    (tmp_path / "processor_config.json").write_text(json.dumps(nested))
    assert read_preprocessor_config(tmp_path) == nested["image_processor"]


def data_url(data, kind="png"):
    return f"data:image/{kind};base64," + base64.b64encode(data).decode()


def png_header_only(width, height):
    """A PNG that declares a size and holds no pixels: only its header is ever read."""

    def chunk(kind, data):
        crc = struct.pack(">I", zlib.crc32(kind + data))
        return struct.pack(">I", len(data)) + kind + data + crc

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    chunks = chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(b"")) + chunk(b"IEND", b"")
    return b"\x89PNG\r\n\x1a\n" + chunks


def test_load_image_reads_data_urls_and_allowed_files(tmp_path):
    image = decoded_png(23, 17, "RGBA")
    data = png_bytes(image)
    loaded = load_image(data_url(data))
    assert loaded.mode == "RGBA" and loaded.size == (23, 17)
    np.testing.assert_array_equal(np.asarray(loaded), np.asarray(image))
    path = tmp_path / "image.png"
    path.write_bytes(data)
    for source in (str(path), path.as_uri()):
        with pytest.raises(ConfigError, match="local files are not read here"):
            load_image(source)
        np.testing.assert_array_equal(np.asarray(load_image(source, allow_files=True)), loaded)
    with pytest.raises(ConfigError, match="missing.png: cannot be read"):
        load_image(str(tmp_path / "missing.png"), allow_files=True)


def test_load_image_refusals_name_what_and_the_limit(tmp_path):
    data = png_bytes(decoded_png(20, 13, "RGB"))
    for url in ("http://example.com/a.png", "https://example.com/a.png", "ftp://host/a.png"):
        with pytest.raises(ConfigError, match=r"images are not fetched"):
            load_image(url, allow_files=True)
    limit = len(data) - 1
    with pytest.raises(ConfigError, match=f"{len(data)} bytes, more than max_bytes={limit}"):
        load_image(data_url(data), max_bytes=limit)
    with pytest.raises(ConfigError, match="base64 characters decode to more than max_bytes=10"):
        load_image(data_url(data), max_bytes=10)
    path = tmp_path / "image.png"
    path.write_bytes(data)
    with pytest.raises(ConfigError, match=f"{len(data)} bytes, more than max_bytes=100"):
        load_image(str(path), allow_files=True, max_bytes=100)
    with pytest.raises(ConfigError, match="20x13 = 260 pixels, more than max_pixels=100"):
        load_image(data_url(data), max_pixels=100)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # Pillow's bomb warning is not let through
        with pytest.raises(ConfigError, match="10000x10000 = 100000000 pixels, more than max_pix"):
            load_image(data_url(png_header_only(10000, 10000)))
        with pytest.raises(ConfigError, match="than Pillow decodes safely.*max_pixels=500000000"):
            load_image(data_url(png_header_only(20000, 20000)), max_pixels=500_000_000)
    with pytest.raises(ConfigError, match="not a decodable image"):
        load_image(data_url(b"just some text"))
    with pytest.raises(ConfigError, match="not a decodable image"):  # fails in .load()
        load_image(data_url(data[: len(data) // 2]))
    with pytest.raises(ConfigError, match="not valid base64"):
        load_image("data:image/png;base64,iVBORw0K*GgoAAAANSUhEUg")
    with pytest.raises(ConfigError, match="must read data:image/<type>;base64,<payload>"):
        load_image("data:text/plain;base64," + base64.b64encode(data).decode())
