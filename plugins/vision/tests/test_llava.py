"""LLaVA against transformers: a tiny random LlavaForConditionalGeneration (CLIP tower, LLaMA
text model, every 1-d weight perturbed) imported, run on real image inputs, decoded and
exported."""

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from axplug_vision.testing import predicted, tiny_llava  # noqa: E402

IMAGE = 95  # the image placeholder token
PROMPT = [1, 7, *[IMAGE] * 16, 12, 30, *[IMAGE] * 16, 44, 3]  # two images of 16 features


def hf_logits(model, ids, pixels):
    with torch.no_grad():
        return model(input_ids=torch.as_tensor(ids), pixel_values=torch.as_tensor(pixels)).logits


def test_llava_imports_decodes_and_exports_equal_to_transformers(tmp_path):
    from axplug_testing import run_cli
    from axplug_vision.prompts import image_embeddings

    from axplug.api.run import Engine, Request, SamplingParams, generate, load_checkpoint

    reference = tiny_llava(vocab_size=96, image_token=IMAGE)
    reference.save_pretrained(tmp_path / "hf")
    processor = transformers.CLIPImageProcessor(size={"shortest_edge": 16},
                                                crop_size={"height": 16, "width": 16})  # fmt: skip
    processor.save_pretrained(tmp_path / "hf")
    from test_preprocess import decoded_png

    # Two decoded PNGs (RGB, grayscale; neither square) as CLIP's processor makes them.
    images = [decoded_png(37, 22, "RGB", seed=5), decoded_png(18, 29, "L", seed=6)]
    pixels = processor(images=images, return_tensors="np")["pixel_values"].astype(np.float32)
    ids = np.asarray([PROMPT], np.int32)
    want = hf_logits(reference, ids, pixels).numpy()

    result = run_cli("import-hf", str(tmp_path / "hf"), "--output", str(tmp_path / "run"),
                     "--set", "mesh.mesh_shape=(1,1,1,1,1)")  # fmt: skip
    assert result.exit_code == 0, result.stderr
    loaded = load_checkpoint(str(tmp_path / "run"))
    model = loaded.model
    # The tower keeps the layers up to vision_feature_layer=-2: 2 of 3.
    assert model.config.vision.transformer.num_layers == 2

    got = predicted(model, loaded.params, {"input_ids": ids, "pixel_values": pixels[None]})
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)

    embeddings = image_embeddings(model, loaded.params, PROMPT, pixels)
    (completion,) = generate(model, loaded.params, [PROMPT],
                             SamplingParams(max_new_tokens=16, temperature=0.0),
                             embeddings=[embeddings])  # fmt: skip
    with torch.no_grad():
        out = reference.generate(
            input_ids=torch.as_tensor(ids, dtype=torch.long),
            pixel_values=torch.as_tensor(pixels), max_new_tokens=16, min_new_tokens=16,
            do_sample=False, eos_token_id=None, pad_token_id=0,
        )  # fmt: skip
    assert list(completion.output_ids) == out[0, len(PROMPT) :].tolist()

    # Embeddings that do not fit the prompt are refused before the request queues.
    engine = Engine(model, loaded.params, num_slots=1, max_len=64)
    where, vectors = embeddings
    bad = {
        "must be \\(prompt indices": (where, vectors[:3]),
        "must rise strictly within the prompt's 38 tokens": (where[::-1], vectors),
    }  # fmt: skip
    for message, wrong in bad.items():
        with pytest.raises(ValueError, match=message):
            engine.submit(Request(PROMPT, embeddings=wrong))

    result = run_cli("export-hf", str(tmp_path / "run"), "--output", str(tmp_path / "out"))
    assert result.exit_code == 0, result.stderr
    exported = transformers.AutoModelForImageTextToText.from_pretrained(tmp_path / "out")
    assert type(exported).__name__ == "LlavaForConditionalGeneration"
    again = hf_logits(exported.float().train(False), ids, pixels).numpy()
    np.testing.assert_allclose(again, want, rtol=0, atol=1e-5)

    # `generate --image`: a PNG through the copied image processor and the model's tower,
    # the prompt's image marker expanded to the model's placeholders.
    from PIL import Image

    rgb = np.random.default_rng(1).integers(0, 256, (40, 28, 3), dtype=np.uint8)
    Image.fromarray(rgb).save(tmp_path / "image.png")
    result = run_cli("generate", "--checkpoint", str(tmp_path / "run"), "--prompt-ids",
                     f"1,7,{IMAGE},12,30", "--image", str(tmp_path / "image.png"),
                     "--max-new-tokens", "16", "--temperature", "0", "--json")  # fmt: skip
    assert result.exit_code == 0, result.stderr
    printed = json.loads(result.stdout)
    expanded = [1, 7, *[IMAGE] * 16, 12, 30]
    assert printed["prompt_ids"] == expanded
    with Image.open(tmp_path / "image.png") as image:
        pixels = processor(images=[image], return_tensors="pt")["pixel_values"]
    with torch.no_grad():
        out = reference.generate(
            input_ids=torch.as_tensor([expanded]), pixel_values=pixels, max_new_tokens=16,
            min_new_tokens=16, do_sample=False, eos_token_id=None, pad_token_id=0,
        )  # fmt: skip
    assert printed["output_ids"] == out[0, len(expanded) :].tolist()
