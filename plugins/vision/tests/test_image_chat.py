"""Image-chat fine-tuning against transformers: a tiny LLaVA (every 1-d weight perturbed)
imported, chats with PNG files and a data URL prepared (the pixels at each image's placeholders
as CLIP's processor makes them, the mask on the assistant's text only), the loss by hand from
transformers' logits, and short runs with the tower frozen and trained (LoRA on the language
model alone: test_docs_vision.py, which fine-tunes as docs/vision.md does)."""

import base64
import io
import json

import jax
import numpy as np
import pytest
from PIL import Image

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from axplug_testing import run_cli  # noqa: E402

IMAGE, PER_IMAGE, WIDTH = 258, 16, 3 * 16 * 16 // 16  # `<image>`, 4x4 patches, values per token
PROCESSOR = {
    "image_processor_type": "CLIPImageProcessor",
    "size": {"shortest_edge": 16},
    "crop_size": {"height": 16, "width": 16},
}
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SEQ = 256  # a row: the training conversations are 69, 94 and 220 tokens long


def train_argv(run, data, out, *extra):
    """`axplug train` of 3 steps from `run` on `data` (two packed rows of whole documents) on
    one device."""
    settings = [
        f"input.seq_len={SEQ}",
        "input.batch_size=2",
        "compilation_cache_dir=None",
        "learner.warmup_steps=0",
        "learner.schedule='constant'",
        "log_every=1",
    ]
    return ["train", "--from", str(run), "--output-dir", str(out), "--input",
            f"token_file:path={data},rows=documents,packing=true", "--max-steps", "3",
            "--mesh-rule", "none", "--modifier", "mesh", "-q",
            *(arg for s in settings for arg in ("--set", s)), *extra]  # fmt: skip


def byte_tokenizer():
    """Every byte a token (byte-level, no merges), then `<pad>`, `</s>`, `<image>` (258)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True) for t in ("<pad>", "</s>", "<image>")])
    assert tok.token_to_id("<image>") == IMAGE
    return tok


def tiny_llava():
    """The tiny LLaVA over the byte tokenizer's 259 ids."""
    from axplug_vision.testing import tiny_llava

    return tiny_llava(vocab_size=259, image_token=IMAGE, pad_token=256, tower_layers=2)


def png(seed, width, height):
    rng = np.random.default_rng(seed)
    buffer = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (height, width, 3), np.uint8)).save(buffer, "PNG")
    return buffer.getvalue()


def chats(tmp):
    """(records, the bytes of each one's images): text only; a relative PNG path; a data URL
    and a file:// URL in one turn of two; text only."""
    (tmp / "a.png").write_bytes(png(0, 20, 30))
    (tmp / "b.png").write_bytes(png(1, 40, 17))
    inline = png(2, 16, 16)

    def image(url):
        return {"type": "image_url", "image_url": {"url": url}}

    def text(t):
        return {"type": "text", "text": t}

    return [
        {"prompt": "Hi", "completion": "Hello."},
        {"messages": [{"role": "user", "content": [image("a.png"), text("What is it?")]},
                      {"role": "assistant", "content": "A cat."}]},
        {"messages": [{"role": "system", "content": "Be brief."},
                      {"role": "user", "content": [
                          text("Compare "),
                          image("data:image/png;base64," + base64.b64encode(inline).decode()),
                          text(" and "), image(f"file://{tmp / 'b.png'}")]},
                      {"role": "assistant", "content": "Same."},
                      {"role": "user", "content": "Sure?"},
                      {"role": "assistant", "content": "Yes."}]},
        {"prompt": "Bye", "completion": "Bye."},  # the held-out split
    ], [[], [(tmp / "a.png").read_bytes()], [inline, (tmp / "b.png").read_bytes()], []]  # fmt: skip


def by_hand(record, tok):
    """(ids, mask) of a record as ChatML renders it: the images as 16 placeholders each, the
    mask 1 on each assistant reply, its <|im_end|> and newline."""
    messages = record.get("messages") or [
        {"role": "user", "content": record["prompt"]},
        {"role": "assistant", "content": record["completion"]},
    ]
    ids, mask = [], []

    def add(piece, trained):
        new = tok.encode(piece).ids if isinstance(piece, str) else piece
        ids.extend(new)
        mask.extend([int(trained)] * len(new))

    for m in messages:
        trained = m["role"] == "assistant"
        add(f"<|im_start|>{m['role']}\n", False)
        parts = m["content"] if isinstance(m["content"], list) else [m["content"]]
        for part in parts:
            if isinstance(part, str) or part["type"] == "text":
                add(part if isinstance(part, str) else part["text"], trained)
            else:
                add([IMAGE] * PER_IMAGE, False)
        add("<|im_end|>\n", trained)
    return np.asarray(ids), np.asarray(mask)


@pytest.fixture(scope="module")
def image_chat(tmp_path_factory):
    """(the transformers model, its import, the prepared data, the records, their images'
    pixel_values by transformers' CLIP processor, the tokenizer): built once, only read."""
    tmp = tmp_path_factory.mktemp("image_chat")
    reference, tok = tiny_llava(), byte_tokenizer()
    reference.save_pretrained(tmp / "hf")
    tok.save(str(tmp / "hf" / "tokenizer.json"))
    (tmp / "hf" / "preprocessor_config.json").write_text(json.dumps(PROCESSOR))
    result = run_cli("import-hf", str(tmp / "hf"), "--output", str(tmp / "run"),
                     "--set", "mesh.mesh_shape=(1,1,1,1,1)")  # fmt: skip
    assert result.exit_code == 0, result.stderr
    records, images = chats(tmp)
    (tmp / "chats.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (tmp / "chatml.jinja").write_text(CHATML)
    result = run_cli("prepare-chat", str(tmp / "chats.jsonl"), "--tokenizer", str(tmp / "run"),
                     "--images", str(tmp / "run"), "--output", str(tmp / "data"),
                     "--chat-template", str(tmp / "chatml.jinja"), "--workers", "1",
                     "--docs-per-shard", "2")  # fmt: skip
    assert result.exit_code == 0, result.stderr
    processor = transformers.AutoImageProcessor.from_pretrained(tmp / "hf", backend="pil")
    pixels = [
        processor([Image.open(io.BytesIO(b)) for b in shown], return_tensors="np").pixel_values
        if shown else np.zeros((0, 3, 16, 16), np.float32)
        for shown in images
    ]  # fmt: skip
    return reference, tmp / "run", tmp / "data", records, pixels, tok


def documents(data):
    """(ids, mask, pixel values [tokens, width]) of each document, across the shards."""
    from axplug.api.data import open_shards, read_meta

    out = []
    for shard in open_shards(data, read_meta(data)):
        values = np.fromfile(shard.path.with_name(f"{shard.path.stem}.image_pixels.bin"),
                             np.float32).reshape(len(shard.tokens), -1)  # fmt: skip
        for a, b in zip(shard.docs[:-1], shard.docs[1:], strict=True):
            out.append((np.asarray(shard.tokens[a:b]), np.asarray(shard.mask[a:b]), values[a:b]))
    return out


def test_prepared_chats_carry_each_images_pixels_and_mask_the_assistants_text(image_chat):
    _, _, data, records, pixels, tok = image_chat
    meta = json.loads((data / "meta.json").read_text())
    assert meta["token_values"] == {
        "image_pixels": {"dtype": "float32", "width": WIDTH, "aligned": "inputs"}
    }
    assert len(meta["shards"]) == 2  # --docs-per-shard 2: each image in its record's shard
    found = documents(data)
    assert len(found) == len(records)
    for (ids, mask, values), record, want in zip(found, records, pixels, strict=True):
        want_ids, want_mask = by_hand(record, tok)
        np.testing.assert_array_equal(ids, want_ids)
        np.testing.assert_array_equal(mask, want_mask)
        placed = ids == IMAGE
        np.testing.assert_array_equal(values[placed], want.reshape(-1, WIDTH))
        assert not values[~placed].any()


@pytest.fixture(scope="module")
def first_batch(image_chat):
    """(the training split's first batch, its loss by hand): each conversation in it alone
    through transformers, the next-token log-likelihood summed over the targets the hand-made
    mask counts, over their number. Its two rows hold the whole split, so every batch is it."""
    from axplug.api.data import TokenFileInput

    reference, _, data, records, pixels, tok = image_chat
    cfg = TokenFileInput.default_config().set(
        path=str(data), rows="documents", packing=True, seq_len=SEQ, batch_size=2
    )
    batch = cfg.instantiate().batch(0)
    total, count, seen = 0.0, 0, 0
    for row, segments in zip(batch["input_ids"], batch["segment_ids"], strict=True):
        for segment in set(segments[segments > 0].tolist()):
            ids = row[segments == segment]
            (k,) = [i for i, r in enumerate(records) if np.array_equal(by_hand(r, tok)[0], ids)]
            _, mask = by_hand(records[k], tok)
            shown = torch.as_tensor(pixels[k]) if len(pixels[k]) else None
            with torch.no_grad():
                ids_in = torch.as_tensor(ids[None], dtype=torch.long)
                logits = reference(input_ids=ids_in, pixel_values=shown).logits[0]
            logp = torch.log_softmax(logits.double(), -1).numpy()
            picked = logp[np.arange(len(ids) - 1), ids[1:]]
            total -= float((picked * mask[1:]).sum())
            count += int(mask[1:].sum())
            seen += 1
    assert seen == 3  # the training split's, in two rows: the first packs two
    return batch, total / count


def test_a_batchs_loss_is_transformers_over_the_assistants_tokens_only(image_chat, first_batch):
    from axplug.api.layers import functional
    from axplug.api.run import load_checkpoint

    batch, want = first_batch
    loaded = load_checkpoint(str(image_chat[1]))
    loss, _ = jax.jit(
        lambda p, b: functional(loaded.model, prng_key=None, state=p, inputs=b,
                                is_training=False)[0]
    )(loaded.params, batch)  # fmt: skip
    assert abs(float(loss) - want) < 1e-5


def _trained(out):
    """(the parameter paths the latest checkpoint of run `out` stores, its losses)."""
    from axplug.api.checkpoint import Checkpointer
    from axplug.api.run import parameter_paths

    with Checkpointer.default_config().set(directory=f"{out}/checkpoints").instantiate() as c:
        paths = jax.tree.leaves(parameter_paths(c.saved_tree(c.latest_step())["params"]))
    lines = (json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines())
    return paths, [r["loss"] for r in lines if "loss" in r]


@pytest.mark.parametrize("tower", ["frozen", "trained"])
def test_training_lowers_the_loss_with_the_tower_frozen_or_trained(image_chat, first_batch, tower):
    _, run, data, *_ = image_chat
    out = run.parent / tower
    frozen = ("--set", "learner.trainable='^(?!vision/)'") if tower == "frozen" else ()
    result = run_cli(*train_argv(run, data, out, "--set", "learner.learning_rate=0.02", *frozen))
    assert result.exit_code == 0, result.stderr
    paths, losses = _trained(out)
    assert abs(losses[0] - first_batch[1]) < 1e-5  # the trainer's first step: the import's
    assert losses[2] < losses[1] < losses[0]
    assert any(p.startswith("projector/") for p in paths)
    # Frozen: the tower is read from the import, not stored; trained: stored with the run.
    assert any(p.startswith("vision/") for p in paths) == (tower == "trained")


def _asking(url):
    """A chat asking about the image at `url`."""
    return {"messages": [
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}]},
        {"role": "assistant", "content": "A cat."}]}  # fmt: skip


REFUSED = {  # record, with --images, the error
    "remote": (_asking("https://example.com/cat.png"), True,
               "record 1 of shard_00000's chunk: messages[0].content[0]: image "
               "'https://example.com/cat.png': remote images are not fetched"),
    "missing": (_asking("nope.png"), True,
                "bad.jsonl record 1: messages[0].content[0]: image "),
    "no --images": (_asking("a.png"), False,
                    "record 1 of shard_00000's chunk: messages[0]: content is a list of parts "
                    "(text, images): `axplug prepare-chat --images RUN` reads them"),
}  # fmt: skip


@pytest.mark.parametrize("name", list(REFUSED))
def test_a_refused_image_is_one_error_naming_its_record(image_chat, tmp_path, name):
    run = image_chat[1]
    record, images, message = REFUSED[name]
    (tmp_path / "bad.jsonl").write_text(json.dumps(record) + "\n")
    argv = ["prepare-chat", str(tmp_path / "bad.jsonl"), "--tokenizer", str(run), "--output",
            str(tmp_path / "out"), "--workers", "1"]  # fmt: skip
    result = run_cli(*argv, *(["--images", str(run)] if images else []))
    assert result.exit_code == 2
    (line,) = result.stderr.strip().splitlines()[-1:]
    assert line.startswith("error: ") and message in line, result.stderr
    assert not (tmp_path / "out" / "meta.json").exists()
