"""Gemma 3 against transformers: a tiny random Gemma3ForConditionalGeneration (SigLIP tower,
Gemma 3 text model with a sliding and a full layer, every 1-d weight perturbed) imported, run
on a prompt with two decoded PNG images (RGBA and grayscale, neither square) wrapped as Gemma
3's processor wraps them, decoded and exported."""

import json
import types

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from axplug_vision.testing import perturbed, predicted  # noqa: E402

BOI, EOI, IMAGE = 100, 101, 102  # begin-of-image, end-of-image, the image placeholder
WRAPPED = [BOI, *[IMAGE] * 4, EOI]  # one image: 4 pooled tokens
PROMPT = [1, 7, 9, *WRAPPED, 12, 30, 5, 8, *WRAPPED, 44, 3, 17]
WRAPPED_NL = [10, 10, *WRAPPED, 10, 10]  # as a prompt's marker expands, "\n\n" as [10, 10]


def tiny_gemma3():
    text = transformers.Gemma3TextConfig(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, query_pre_attn_scalar=8,
        sliding_window=6, layer_types=["sliding_attention", "full_attention"],
        max_position_embeddings=128, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    vision = transformers.SiglipVisionConfig(
        hidden_size=24, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        image_size=16, patch_size=4, vision_use_head=False,
    )  # fmt: skip
    config = transformers.Gemma3Config(
        text_config=text, vision_config=vision, mm_tokens_per_image=4,
        boi_token_index=BOI, eoi_token_index=EOI, image_token_index=IMAGE,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.Gemma3ForConditionalGeneration(config)
    with torch.no_grad():  # transformers starts the projection at zeros
        model.model.multi_modal_projector.mm_input_projection_weight.normal_(0, 0.2)
    return perturbed(model)


def hf_inputs(ids, pixels):
    ids = torch.as_tensor(ids, dtype=torch.long)
    # The processor's token types: 1 at the placeholders, so each image's run is bidirectional.
    return dict(input_ids=ids, pixel_values=torch.as_tensor(pixels),
                token_type_ids=(ids == IMAGE).long())  # fmt: skip


def hf_logits(model, ids, pixels):
    with torch.no_grad():
        return model(**hf_inputs(ids, pixels)).logits.numpy()


PROCESSOR = {"image_processor_type": "Gemma3ImageProcessor", "size": {"height": 16, "width": 16}}


def processed_images(tmp_path):
    """(transformers' pixel values, axplug's) of two decoded PNGs, each processor's settings
    read from one preprocessor_config.json."""
    from axplug_vision.preprocess import image_processor, read_preprocessor_config

    from test_preprocess import decoded_png, reference_processor

    images = [decoded_png(40, 23, "RGBA", seed=3), decoded_png(19, 31, "L", seed=4)]
    theirs = reference_processor(PROCESSOR, tmp_path)(images, return_tensors="np")
    ours = image_processor(read_preprocessor_config(tmp_path))(images)
    return theirs["pixel_values"], ours["pixel_values"]


def test_gemma3_imports_decodes_and_exports_equal_to_transformers(tmp_path):
    from axplug_testing import run_cli
    from axplug_vision.prompts import image_embeddings

    from axplug.api.run import Engine, Request, SamplingParams, generate, load_checkpoint

    reference = tiny_gemma3()
    reference.save_pretrained(tmp_path / "hf")
    hf_pixels, pixels = processed_images(tmp_path)
    np.testing.assert_allclose(pixels, hf_pixels, rtol=0, atol=1e-5)
    ids = np.asarray([PROMPT], np.int32)
    want = hf_logits(reference, ids, hf_pixels)

    result = run_cli("import-hf", str(tmp_path / "hf"), "--output", str(tmp_path / "run"),
                     "--set", "mesh.mesh_shape=(1,1,1,1,1)")  # fmt: skip
    assert result.exit_code == 0, result.stderr
    loaded = load_checkpoint(str(tmp_path / "run"))
    model = loaded.model
    # A prompt marks an image by <start_of_image>; the model's sequence is Gemma 3's processor's:
    # "\n\n", <start_of_image>, the placeholders, <end_of_image>, "\n\n".
    from axplug_vision.prompts import expand_images, image_marker

    newlines = types.SimpleNamespace(encode=lambda text: [10] * len(text))
    assert image_marker(model.config) == BOI
    assert expand_images([1, BOI, 5], model.config, newlines) == [1, *WRAPPED_NL, 5]
    assert model.tokens_per_image(model.config) == 4
    assert (model.config.image_begin_id, model.config.image_end_id) == (BOI, EOI)

    def predict(model):
        return predicted(model, loaded.params, {"input_ids": ids, "pixel_values": pixels[None]})

    got = predict(model)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)
    # An image's first token sees the image's later tokens: without that, it computes else.
    causal = predict(model.config.clone(bidirectional_images=False).instantiate(parent=None))
    first = PROMPT.index(IMAGE)
    assert np.abs(causal[0, first] - want[0, first]).max() > 1e-3

    embeddings = image_embeddings(model, loaded.params, PROMPT, pixels)
    (completion,) = generate(model, loaded.params, [PROMPT],
                             SamplingParams(max_new_tokens=16, temperature=0.0),
                             embeddings=[embeddings])  # fmt: skip
    with torch.no_grad():
        out = reference.generate(**hf_inputs(ids, hf_pixels), max_new_tokens=16, min_new_tokens=16,
                                 do_sample=False, eos_token_id=None, pad_token_id=0)  # fmt: skip
    assert list(completion.output_ids) == out[0, len(PROMPT) :].tolist()
    # Prefilled 6 tokens at a time: a chunk ends before an image rather than cutting it (its
    # first tokens would miss its later ones), so the tokens stay the same.
    engine = Engine(model, loaded.params, num_slots=1, max_len=64, prefill_chunk=6)
    sampling = SamplingParams(max_new_tokens=16, temperature=0.0)
    engine.submit(Request(PROMPT, sampling, embeddings=embeddings))
    (chunked,) = engine.run()
    assert chunked.output_ids == completion.output_ids

    result = run_cli("export-hf", str(tmp_path / "run"), "--output", str(tmp_path / "out"))
    assert result.exit_code == 0, result.stderr
    written = json.loads((tmp_path / "out" / "config.json").read_text())
    assert (written["boi_token_index"], written["eoi_token_index"]) == (BOI, EOI)
    exported = transformers.AutoModelForImageTextToText.from_pretrained(tmp_path / "out")
    assert type(exported).__name__ == "Gemma3ForConditionalGeneration"
    again = hf_logits(exported.float().train(False), ids, hf_pixels)
    np.testing.assert_allclose(again, want, rtol=0, atol=1e-5)


def test_a_projector_that_cannot_pool_the_patches_is_an_error():
    from axplug_vision.gemma3 import Gemma3Projector

    from axplug.api.config import ConfigError
    from axplug.api.layers import functional

    cfg = Gemma3Projector.default_config().set(input_dim=8, output_dim=4, tokens_per_image=5)
    with pytest.raises(ConfigError, match="tokens_per_image: 5 is not a square number"):
        cfg.instantiate(parent=None)
    projector = cfg.set(tokens_per_image=9).instantiate(parent=None)
    rng = np.random.default_rng(0)
    params = {
        "norm": {"scale": rng.normal(size=8)},
        "projection": {"weight": rng.normal(size=(8, 4))},
    }
    features = rng.normal(size=(2, 36, 8)).astype(np.float32)
    with pytest.raises(ConfigError, match="9 does not pool a 4x4 grid of 16 patches"):
        functional(projector, prng_key=None, state=params, inputs=(features[:1, :16],),
                   is_training=False)  # fmt: skip
    # A 6x6 grid pooled 2x2 to 9 tokens, (1 + w) RMS-normed, projected: numpy, float64.
    got, _ = functional(projector, prng_key=None, state=params, inputs=(features,),
                        is_training=False)  # fmt: skip
    pooled = features.astype(np.float64).reshape(2, 3, 2, 3, 2, 8).mean((2, 4)).reshape(2, 9, 8)
    normed = pooled / np.sqrt(np.mean(pooled**2, -1, keepdims=True) + cfg.norm.eps)
    want = normed * (1 + params["norm"]["scale"]) @ params["projection"]["weight"]
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)
