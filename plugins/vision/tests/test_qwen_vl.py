"""Qwen2.5-VL against transformers: a tiny random Qwen2_5_VLForConditionalGeneration (windowed
tower, Qwen2 text model with multimodal rotary positions, every 1-d weight perturbed) imported,
run on a prompt with two images of different grids wrapped as the processor wraps them, and
exported."""

import json
import types

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from axplug_vision.testing import perturbed, predicted  # noqa: E402

IMAGE, VIDEO, START, END = 151, 152, 153, 154  # <|image_pad|>, <|video_pad|>, <|vision_*|>
# Patches per image (time, rows, columns): 2x3 and 3x2 merged tokens, one window partial.
GRID_THW = np.array([[1, 4, 6], [1, 6, 4]])
PROMPT = [1, 7, 9, START, *[IMAGE] * 6, END, 12, 30, 5, START, *[IMAGE] * 6, END, 44, 3, 17]
TEXT = dict(
    vocab_size=160, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [1, 1, 2]},
    bos_token_id=1, eos_token_id=2, pad_token_id=0,
)  # fmt: skip
VISION = dict(
    depth=2, fullatt_block_indexes=[1], hidden_size=32, num_heads=4, intermediate_size=48,
    patch_size=4, temporal_patch_size=2, spatial_merge_size=2, out_hidden_size=32,
    window_size=16,  # 2x2 merged tokens
)  # fmt: skip


PROCESSOR = {  # Qwen2-VL's processor for the tiny tower: 4-pixel patches, merged 2 x 2
    "image_processor_type": "Qwen2VLImageProcessor", "patch_size": 4, "merge_size": 2,
    "temporal_patch_size": 2, "min_pixels": 64, "max_pixels": 1024,
}  # fmt: skip


def tiny_qwen_vl():
    config = transformers.Qwen2_5_VLConfig(
        text_config=TEXT, vision_config=VISION, image_token_id=IMAGE, video_token_id=VIDEO,
        vision_start_token_id=START, vision_end_token_id=END,
    )  # fmt: skip
    torch.manual_seed(0)
    return perturbed(transformers.Qwen2_5_VLForConditionalGeneration(config))


def hf_logits(model, ids, patches):
    ids = torch.as_tensor(ids, dtype=torch.long)
    with torch.no_grad():
        return model(
            input_ids=ids, pixel_values=torch.as_tensor(patches),
            image_grid_thw=torch.as_tensor(GRID_THW), mm_token_type_ids=(ids == IMAGE).int(),
        ).logits.numpy()  # fmt: skip


def test_qwen_vl_imports_and_exports_equal_to_transformers(tmp_path):
    from axplug_testing import run_cli
    from axplug_vision.prompts import _encoder, rotary_embeddings
    from axplug_vision.qwen_rope import rope_index
    from axplug_vision.qwen_tower import qwen_vision_inputs

    from axplug.api.run import Engine, Request, SamplingParams, generate, load_checkpoint

    reference = tiny_qwen_vl()
    reference.save_pretrained(tmp_path / "hf")
    patches = np.random.default_rng(0).standard_normal((48, 96)).astype(np.float32)
    ids = np.asarray([PROMPT], np.int32)
    want = hf_logits(reference, ids, patches)

    result = run_cli("import-hf", str(tmp_path / "hf"), "--output", str(tmp_path / "run"),
                     "--set", "mesh.mesh_shape=(1,1,1,1,1)")  # fmt: skip
    assert result.exit_code == 0, result.stderr
    loaded = load_checkpoint(str(tmp_path / "run"))
    model = loaded.model
    assert (model.config.image_begin_id, model.config.image_end_id) == (START, END)

    positions, delta = rope_index(PROMPT, GRID_THW, model.config)
    hf_positions, hf_delta = reference.model.get_rope_index(
        torch.as_tensor(ids, dtype=torch.long), torch.as_tensor(ids == IMAGE).int(),
        image_grid_thw=torch.as_tensor(GRID_THW),
    )  # fmt: skip
    np.testing.assert_array_equal(positions, hf_positions[:, 0].T.numpy())
    assert delta == hf_delta.item() == -6  # each image: 6 tokens, 3 positions on

    inputs = {
        "input_ids": ids,
        "pixel_values": patches,
        "vision_inputs": qwen_vision_inputs(GRID_THW, model.config.vision),
        "rope_positions": positions[None],
    }
    got = predicted(model, loaded.params, inputs)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)

    # 16 greedy tokens through the engine: the prompt's tokens carry their rotary positions,
    # the generated ones their index plus the prompt's offset (kept per row in the cache);
    # whole, and prefilled 5 tokens at a time.
    encode = _encoder(model)
    features = encode(loaded.params, patches, inputs["vision_inputs"])
    embeddings = rotary_embeddings(model.config, PROMPT, GRID_THW, features)
    sampling = SamplingParams(max_new_tokens=16, temperature=0.0, logprobs=0)
    (completion,) = generate(model, loaded.params, [PROMPT], sampling, embeddings=[embeddings])
    with torch.no_grad():
        out = reference.generate(
            input_ids=torch.as_tensor(ids, dtype=torch.long),
            pixel_values=torch.as_tensor(patches), image_grid_thw=torch.as_tensor(GRID_THW),
            mm_token_type_ids=torch.as_tensor(ids == IMAGE).int(), max_new_tokens=16,
            min_new_tokens=16, do_sample=False, eos_token_id=None, pad_token_id=0,
            output_logits=True, return_dict_in_generate=True,
        )  # fmt: skip
    assert list(completion.output_ids) == out.sequences[0, len(PROMPT) :].tolist()
    # Each token's log-probability too: a generated token's rotary position (its index plus
    # the prompt's offset) shows there even where the greedy choice does not change.
    hf_logprobs = [torch.log_softmax(step[0], -1)[t].item()
                   for step, t in zip(out.logits, completion.output_ids, strict=True)]  # fmt: skip
    ours = [entry.logprob for entry in completion.output_logprobs]
    np.testing.assert_allclose(ours, hf_logprobs, rtol=0, atol=1e-5)
    engine = Engine(model, loaded.params, num_slots=2, max_len=64, prefill_chunk=5)
    engine.submit(Request(PROMPT, sampling, embeddings=embeddings))
    engine.submit(Request(PROMPT[:3], sampling))  # no image: its row's offset stays 0
    chunked, text_only = sorted(engine.run(), key=lambda c: c.id)
    assert chunked.output_ids == completion.output_ids
    (alone,) = generate(model, loaded.params, [PROMPT[:3]], sampling)
    assert text_only.output_ids == alone.output_ids
    # Twice over a paged cache: the second's pages past the first image come from the prefix
    # cache, and its row restarts there, finding its positions in what it feeds.
    paged = load_checkpoint(str(tmp_path / "run"), modifiers=["paged_kv_cache:page_size=4"])
    engine = Engine(paged.model, paged.params, num_slots=1, max_len=64)
    for _ in range(2):
        engine.submit(Request(PROMPT, sampling, embeddings=embeddings))
        (again,) = engine.run()
        assert again.output_ids == completion.output_ids
    assert engine.prefix_hit_tokens >= 16  # past the first image (tokens 4 to 9)
    # A rewound or moved row would lose its offset: speculation and moving rows are refused.
    with pytest.raises(ValueError, match="per-row position state"):
        Engine(model, loaded.params, num_slots=1, max_len=64, speculative="ngram")
    with pytest.raises(ValueError, match="per-row position state"):
        engine.detach_decoding()

    # A photo through the model's own processor (dynamic resolution: 24 x 32 pixels are 6 x 8
    # patches, 12 placeholders) and the prompt hook that `generate --image` and `serve` call.
    from PIL import Image

    (tmp_path / "run" / "preprocessor_config.json").write_text(json.dumps(PROCESSOR))
    image = Image.fromarray(np.random.default_rng(2).integers(0, 256, (24, 32, 3), np.uint8))
    prompt, embeddings = model.prompt_with_images(
        loaded.params, [1, 7, START, IMAGE, END, 12], [image], directories=[str(tmp_path / "run")]
    )  # fmt: skip
    assert prompt == [1, 7, START, *[IMAGE] * 12, END, 12]
    (tmp_path / "hf" / "preprocessor_config.json").write_text(json.dumps(PROCESSOR))
    processor = transformers.AutoImageProcessor.from_pretrained(tmp_path / "hf", backend="pil")
    processed = processor(images=[image], return_tensors="pt")
    (completion,) = generate(model, loaded.params, [prompt], sampling, embeddings=[embeddings])
    prompt_ids = torch.as_tensor([prompt])
    with torch.no_grad():
        out = reference.generate(
            input_ids=prompt_ids, pixel_values=processed["pixel_values"],
            image_grid_thw=processed["image_grid_thw"],
            mm_token_type_ids=(prompt_ids == IMAGE).int(), max_new_tokens=16,
            min_new_tokens=16, do_sample=False, eos_token_id=None, pad_token_id=0,
        )  # fmt: skip
    assert list(completion.output_ids) == out[0, len(prompt) :].tolist()

    result = run_cli("export-hf", str(tmp_path / "run"), "--output", str(tmp_path / "out"))
    assert result.exit_code == 0, result.stderr
    written = json.loads((tmp_path / "out" / "config.json").read_text())
    assert written["text_config"]["rope_parameters"]["mrope_section"] == [1, 1, 2]
    exported = transformers.AutoModelForImageTextToText.from_pretrained(tmp_path / "out")
    assert type(exported).__name__ == "Qwen2_5_VLForConditionalGeneration"
    again = hf_logits(exported.float().train(False), ids, patches)
    np.testing.assert_allclose(again, want, rtol=0, atol=1e-5)


def test_the_hubs_flat_config_and_older_rope_scaling_read_as_transformers_does(tmp_path):
    from axplug.api.interop import hf_trainer_config, parse_hf_config

    config = transformers.Qwen2_5_VLConfig(text_config=TEXT, vision_config=VISION,
                                           image_token_id=IMAGE)  # fmt: skip
    nested = json.loads(config.to_json_string(use_diff=False))
    # The Hub's layout: the text model's fields at the top level, RoPE as `rope_scaling`.
    flat = {k: v for k, v in nested.items() if k != "text_config"}
    flat |= {k: v for k, v in nested["text_config"].items() if k != "model_type"}
    flat |= {"rope_parameters": None, "rope_theta": 500.0,
             "rope_scaling": {"type": "mrope", "mrope_section": [2, 1, 1]}}  # fmt: skip
    flat["vision_config"] = {k: v for k, v in VISION.items()}  # no model_type, as the Hub's
    want = transformers.Qwen2_5_VLConfig(**flat).text_config.rope_parameters
    assert (want["rope_theta"], want["mrope_section"]) == (500.0, [2, 1, 1])

    def model(raw):
        return hf_trainer_config(parse_hf_config(raw), output_dir=str(tmp_path)).model

    read = model(flat)
    rope = read.decoder.transformer.layer.attention.position
    assert (rope.theta, rope.mrope_section) == (500.0, (2, 1, 1))
    rope.set(theta=10000.0, mrope_section=(1, 1, 2))
    assert read == model(nested)


def test_rotary_sections_and_grids_that_do_not_fit_are_errors():
    from axplug_vision.qwen_rope import MultimodalRotaryTransform, rope_index

    from axplug.api.config import ConfigError

    rope = MultimodalRotaryTransform.default_config().set(head_dim=8)
    with pytest.raises(ConfigError, match=r"\[16, 24, 24\] sums to 64 pairs; head_dim 8 has 4"):
        rope.instantiate(parent=None)
    merge = types.SimpleNamespace(spatial_merge_size=2)
    cfg = types.SimpleNamespace(image_token_id=IMAGE, vision=merge)
    with pytest.raises(ConfigError, match="image 1's grid \\[1, 6, 4\\] needs 6 placeholders"):
        rope_index(PROMPT[:-5], GRID_THW, cfg)
    with pytest.raises(ConfigError, match="image_grid_thw: 2 images, but .* fill 1"):
        rope_index(PROMPT[:10], GRID_THW, cfg)
