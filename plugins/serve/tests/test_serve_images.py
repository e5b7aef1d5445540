"""Images in chat messages: a tiny LLaVA made with transformers, imported and served, answers
an image sent by the OpenAI client with transformers' own greedy tokens, and with those of
`axplug generate --image` on the same prompt; each refused image is one 400."""

import base64
import io

import numpy as np
import pytest

pytest.importorskip("axplug_serve")
pytest.importorskip("axplug_vision")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
testing = pytest.importorskip("axplug_vision.testing")  # the tiny LLaVA

from PIL import Image  # noqa: E402

IMAGE = 95  # LLaVA's image placeholder: the tokenizer's "<image>", the last of 96 ids
PER_IMAGE = 16  # a 16-pixel image in 4-pixel patches
SPECIALS = ["<pad>", "<s>", "</s>"]
CHARS = " \n:?.,!'" + "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789"
LIMITS = {"--max-image-bytes": 2048, "--max-image-pixels": 1024, "--max-images-per-request": 2}


def char_tokenizer(directory):
    """A tokenizer.json of one token per character, `<image>` an added token (id 95)."""
    from tokenizers import Tokenizer, decoders, models

    vocab = {token: i for i, token in enumerate([*SPECIALS, "<unk>", *CHARS])}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.decoder = decoders.Fuse()
    unused = [f"<unused{i}>" for i in range(len(vocab), IMAGE)]
    tok.add_special_tokens([*SPECIALS, "<unk>", *unused, "<image>"])
    tok.save(str(directory / "tokenizer.json"))
    assert tok.token_to_id("<image>") == IMAGE
    return tok


def png(pixels: np.ndarray) -> bytes:
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return out.getvalue()


def data_url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


def chat(urls: list[str], text: str = "What is this?") -> list[dict]:
    parts = [{"type": "text", "text": text}]
    parts += [{"type": "image_url", "image_url": {"url": url}} for url in urls]
    return [{"role": "user", "content": parts}]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(base URL, transformers' model, its processor, the tokenizer, the run): the LLaVA
    imported with `axplug import-hf` and served on a thread of this process."""
    from axplug_serve.testing import serve_in_thread
    from axplug_testing import run_cli

    root = tmp_path_factory.mktemp("llava")
    reference = testing.tiny_llava(vocab_size=96, image_token=IMAGE)
    reference.save_pretrained(root / "hf")
    processor = transformers.CLIPImageProcessor(size={"shortest_edge": 16},
                                                crop_size={"height": 16, "width": 16})  # fmt: skip
    processor.save_pretrained(root / "hf")
    tokenizer = char_tokenizer(root / "hf")
    result = run_cli("import-hf", str(root / "hf"), "--output", str(root / "llava"),
                     "--set", "mesh.mesh_shape=(1,1,1,1,1)")  # fmt: skip
    assert result.exit_code == 0, result.stderr
    options = ["--checkpoint", str(root / "llava"), "--num-slots", "1", "--max-len", "96",
               "--prefill-chunk", "0", "--no-warmup"]  # fmt: skip
    options += [str(x) for option in LIMITS.items() for x in option]
    with serve_in_thread(options, root / "server.log") as base:
        yield base, reference, processor, tokenizer, root / "llava"


def metric(base: str, name: str) -> float:
    from axplug_serve.testing import metric_value

    return metric_value(httpx.get(base + "/metrics", timeout=60).text, name)


def hf_greedy(reference, processor, ids: list[int], image: bytes, n: int) -> list[int]:
    with Image.open(io.BytesIO(image)) as opened:
        pixels = processor(images=[opened], return_tensors="pt")["pixel_values"]
    with torch.no_grad():
        out = reference.generate(
            input_ids=torch.as_tensor([ids]), pixel_values=pixels, max_new_tokens=n,
            min_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0,
        )  # fmt: skip
    return out[0, len(ids) :].tolist()


def test_the_openai_client_gets_transformers_greedy_tokens_for_an_image(served, tmp_path):
    import json

    from axplug_testing import run_cli

    base, reference, processor, tokenizer, run = served
    client = openai.OpenAI(base_url=base + "/v1", api_key="-", max_retries=0, timeout=120)
    # The default chat template's prompt, its image marker expanded to 16 placeholders.
    text = [tokenizer.encode(t, add_special_tokens=False).ids
            for t in ("user: What is this?", "\n\nassistant:")]  # fmt: skip
    ids = [*text[0], *[IMAGE] * PER_IMAGE, *text[1]]
    replies = []
    hits = metric(base, "axplug_serve_prefix_cache_hits_total")
    # A black image, then a white one after the same text: prefix caching must not give the
    # second the first's cached pages from the image on (the prompts' tokens are the same;
    # the engine salts pages with the features), and the two replies differ. The page before
    # the image (16 of the text's 19 tokens) is the first's, read from the cache.
    for value in (0, 255):
        image = png(np.full((12, 20, 3), value, np.uint8))
        out = client.chat.completions.create(
            model="llava", messages=chat([data_url(image)]), max_tokens=16, temperature=0,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        want = hf_greedy(reference, processor, ids, image, 16)
        reply = tokenizer.decode(want, skip_special_tokens=False)
        assert out.choices[0].message.content == reply
        assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (len(ids), 16)
        replies.append(want)
    assert replies[0] != replies[1]
    assert metric(base, "axplug_serve_prefix_cache_hits_total") - hits == 16
    # `axplug generate --image` on the prompt's ids (its marker, one <image>) and the white
    # image (the last one sent); its 16 tokens hold no end-of-sequence id, so none stops it.
    (tmp_path / "white.png").write_bytes(png(np.full((12, 20, 3), 255, np.uint8)))
    marked = [*text[0], IMAGE, *text[1]]
    result = run_cli("generate", "--checkpoint", str(run), "--image", str(tmp_path / "white.png"),
                     "--prompt-ids", ",".join(map(str, marked)), "--max-new-tokens", "16",
                     "--temperature", "0", "--json")  # fmt: skip
    assert result.exit_code == 0, result.stderr
    printed = json.loads(result.stdout)
    assert (printed["prompt_ids"], printed["output_ids"]) == (ids, replies[1])
    # /tokenize counts the expanded prompt, as usage does.
    body = {"messages": chat([data_url(image)]), "add_special_tokens": False}
    assert httpx.post(base + "/tokenize", json=body, timeout=60).json()["tokens"] == ids


@pytest.mark.parametrize(
    "urls, message",
    [
        ([data_url(png(np.random.default_rng(1).integers(0, 256, (40, 40, 3), np.uint8)))],
         "more than max_bytes=2048"),
        ([data_url(png(np.zeros((200, 200, 3), np.uint8)))], "more than max_pixels=1024"),
        (["data:image/png;base64,@@@@"], "not valid base64"),
        ([data_url(b"no picture at all")], "not a decodable image"),
        ([data_url(png(np.zeros((8, 8, 3), np.uint8)))] * 3, "at most 2"),
        (["http://example.com/cat.png"], "not fetched"),
        (["https://example.com/cat.png"], "not fetched"),
        (["/etc/hostname"], "--allow-local-images"),
        (["file:///etc/hostname"], "--allow-local-images"),
    ],
    ids=["bytes", "pixels", "base64", "not-an-image", "too-many", "http", "https", "path",
         "file-url"],
)  # fmt: skip
def test_each_refused_image_is_one_400(served, urls, message):
    base = served[0]
    body = {"model": "llava", "messages": chat(urls), "max_tokens": 2}
    answer = httpx.post(base + "/v1/chat/completions", json=body, timeout=60)
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert message in error["message"] and error["type"] == "invalid_request_error", error


def test_image_parts_are_checked_and_a_text_model_refuses_them():
    import asyncio
    from types import SimpleNamespace

    from axplug_serve.chat import prompt_of
    from axplug_serve.protocol import APIError, ChatCompletionRequest

    with pytest.raises(ValueError, match="part 1: a content part is"):
        ChatCompletionRequest(model="m", messages=[{"role": "user", "content": [
            {"type": "text", "text": "hi"}, {"type": "input_audio"}]}])  # fmt: skip
    body = ChatCompletionRequest(model="m", messages=chat(["data:image/png;base64,AAAA"]))
    assert body.messages[0].for_template("<image>")["content"] == "What is this?<image>"
    api = SimpleNamespace(settings=SimpleNamespace(images=None, model_name="m"))
    with pytest.raises(APIError, match="takes no images") as refused:
        asyncio.run(prompt_of(api, body))
    assert refused.value.status == 400


def test_local_images_reach_the_model_hook_only_with_the_flag():
    import asyncio
    from types import SimpleNamespace

    from axplug_serve.images import ImagePrompts

    from axplug.api.config import ConfigError

    calls = []
    model = SimpleNamespace(prompt_with_images=lambda *args, **kw: calls.append(kw) or ([1], None))
    for allow in (True, False):
        prompts = ImagePrompts(model, None, None, ["run"], max_images=2, max_bytes=10,
                               max_pixels=10, allow_files=allow)  # fmt: skip
        for url in ("photo.png", "file:///data/photo.png", "data:image/png;base64,AAAA"):
            if allow or url.startswith("data:"):
                assert asyncio.run(prompts.prompt([IMAGE], [url])) == ([1], None)
                assert calls[-1]["allow_files"] == allow and calls[-1]["directories"] == ["run"]
            else:
                with pytest.raises(ConfigError, match="--allow-local-images"):
                    asyncio.run(prompts.prompt([IMAGE], [url]))
    assert len(calls) == 4
