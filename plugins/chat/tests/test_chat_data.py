"""Chat fine-tuning data: the loss counts exactly the assistant's tokens, packed or not."""

import json
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from axplug_chat import ChatTemplate, rendered_segments
from axplug_testing import cli_main as main
from axplug_testing import tiny_trainer_config

from axplug.api.data import load_tokenizer
from axplug.api.layers import functional

CHATS = [
    {"messages": [{"role": "system", "content": "Be brief."},
                  {"role": "user", "content": "Name a prime."},
                  {"role": "assistant", "content": "Seven."},
                  {"role": "user", "content": "Another?"},
                  {"role": "assistant", "content": "Eleven, then thirteen."}]},
    {"prompt": "What is the capital of France?", "completion": "Paris."},
    {"messages": [{"role": "user", "content": "Say hi."},
                  {"role": "assistant", "content": "Hi!"}]},
] * 4  # fmt: skip

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture
def chat_data(tmp_path):
    source = tmp_path / "chats.jsonl"
    source.write_text("".join(json.dumps(c) + "\n" for c in CHATS))
    template = tmp_path / "chatml.jinja"
    template.write_text(CHATML)
    out = tmp_path / "data"
    argv = ["prepare-chat", str(source), "--tokenizer", "bytes", "--output", str(out),
            "--chat-template", str(template), "--workers", "1"]  # fmt: skip
    assert main(argv) == 0
    return out


def _assistant_spans(text, messages):
    """Byte ranges of each reply as ChatML renders it (content, <|im_end|> and newline),
    found by searching the text: independent of the segmenting under test."""
    spans, at = [], 0
    for m in messages:
        if m["role"] != "assistant":
            continue
        head = f"<|im_start|>assistant\n{m['content']}<|im_end|>\n"
        start = text.index(head, at) + len("<|im_start|>assistant\n")
        end = start + len(head) - len("<|im_start|>assistant\n")
        spans.append((len(text[:start].encode()), len(text[:end].encode())))
        at = end
    return spans


def test_the_mask_covers_exactly_the_assistant_replies(chat_data):
    meta = json.loads((chat_data / "meta.json").read_text())
    assert meta["loss_mask"] is True and meta["train_on"] == "assistant"
    assert (chat_data / "chat_template.jinja").read_text() == CHATML
    tokens = np.fromfile(chat_data / "shard_00000.bin", np.uint16)
    mask = np.fromfile(chat_data / "shard_00000.mask.bin", np.uint8)
    docs = np.load(chat_data / "shard_00000.docs.npy")
    template = ChatTemplate(CHATML)
    for i, chat in enumerate(CHATS):
        messages = chat.get("messages") or [
            {"role": "user", "content": chat["prompt"]},
            {"role": "assistant", "content": chat["completion"]},
        ]
        text = template.render(messages, add_generation_prompt=False)
        doc = slice(docs[i], docs[i + 1])
        assert bytes(tokens[doc].astype(np.uint8)) == text.encode()
        want = np.zeros(len(text.encode()), np.uint8)
        for a, b in _assistant_spans(text, messages):
            want[a:b] = 1
        np.testing.assert_array_equal(mask[doc], want)


def _trainer(tmp_path, data, packing, batch_size=2):
    from axplug.api.data import TokenFileInput

    cfg = tiny_trainer_config(tmp_path / "run", preset="llama-tiny")
    data_cfg = TokenFileInput.default_config().set(
        path=str(data), rows="documents", packing=packing, seq_len=512, batch_size=batch_size,
        eval_fraction=0.1,
    )  # fmt: skip
    model = cfg.model.clone(name="model").instantiate(parent=None)
    return types.SimpleNamespace(model=model, input=data_cfg.instantiate())


def _token_losses(trainer, params, batches):
    """(sum of per-token cross entropy over counted targets, their number) of each batch, by
    hand."""
    predict = jax.jit(  # one program per shape, not one per op
        lambda params, inputs: functional(trainer.model, prng_key=None, state=params,
                                          method="predict", inputs=inputs, is_training=False)[0]
    )  # fmt: skip
    keys, out = ("input_ids", "positions", "segment_ids"), []
    for batch in batches:
        logits = predict(params, {k: jnp.asarray(batch[k]) for k in keys if k in batch})
        logp = np.asarray(jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1), np.float64)
        labels = batch["target_labels"]
        counted = labels >= 0
        picked = np.take_along_axis(logp, np.maximum(labels, 0)[..., None], -1)[..., 0]
        out.append((float(-(picked * counted).sum()), int(counted.sum())))
    return out


def test_the_loss_is_the_mean_over_assistant_tokens_and_packing_keeps_it(tmp_path, chat_data):
    plain = _trainer(tmp_path / "plain", chat_data, packing=False)
    params = plain.model.initialize_parameters_recursively(jax.random.PRNGKey(0))
    text = ChatTemplate(CHATML)
    # One conversation per row: the counted targets are the replies' bytes.
    batch = plain.input.batch(0)
    for row in range(2):
        ids = batch["input_ids"][row]
        labels = batch["target_labels"][row]
        counted = bytes(labels[labels >= 0].astype(np.uint8)).decode()
        decoded = bytes(ids.astype(np.uint8)).split(b"\0")[0].decode()
        segments = rendered_segments(text, _messages_of(decoded), "assistant")
        assert counted == "".join(s for s, trained in segments if trained)
    (loss, _), _ = functional(plain.model, prng_key=None, state=params, is_training=False,
                              inputs={k: jnp.asarray(v) for k, v in batch.items()})  # fmt: skip
    ((total, count),) = _token_losses(plain, params, [batch])
    assert abs(float(loss) - total / count) < 1e-5
    # Every training conversation once: the same loss, packed or not.
    sums = []
    one_row = [_trainer(tmp_path, chat_data, packing, batch_size=1) for packing in (False, True)]
    for trainer in one_row:
        seen = [trainer.input.batch(s) for s in range(trainer.input.num_windows)]
        per = _token_losses(trainer, params, seen)
        sums.append((sum(t for t, _ in per), sum(c for _, c in per)))
    assert one_row[1].input.num_windows < one_row[0].input.num_windows / 2  # packed rows
    assert sums[0][1] == sums[1][1]
    np.testing.assert_allclose(sums[0][0], sums[1][0], rtol=1e-6)


def _messages_of(text):
    """The messages of a ChatML conversation text."""
    out = []
    for part in text.split("<|im_start|>")[1:]:
        role, content = part.split("\n", 1)
        out.append({"role": role, "content": content.split("<|im_end|>")[0]})
    return out


def test_serve_finds_the_datas_template(chat_data):
    from axplug_chat import ChatTemplate

    meta = json.loads((chat_data / "meta.json").read_text())
    found = ChatTemplate.for_tokenizer(
        load_tokenizer("bytes"), str(chat_data / meta["chat_template"]["file"])
    )
    assert found.source == CHATML


def test_a_bad_record_is_one_error_naming_it(tmp_path, capsys):
    source = tmp_path / "bad.jsonl"
    source.write_text(json.dumps({"messages": [{"role": "robot", "content": "x"}]}) + "\n")
    argv = ["prepare-chat", str(source), "--tokenizer", "bytes", "--output",
            str(tmp_path / "out"), "--workers", "1"]  # fmt: skip
    assert main(argv) != 0
    err = capsys.readouterr().err
    assert "error:" in err and "record 1" in err and "messages[0]: role must be one of" in err
    assert not (tmp_path / "out" / "meta.json").exists()


LOOPS = {  # templates that came with a model and never finish (or eat the memory)
    "huge range": ("{% for i in range(10**8) %}x{% endfor %}", "range of 100000000 items"),
    "nested loops": ("{% for i in range(99999) %}{% for j in range(99999) %}{% endfor %}"
                     "{% endfor %}", "rendering took over 0.5 s"),
    "repeated text": ("{{ 'x' * 10**9 }}", "a sequence repeated to 1000000000 items"),
}  # fmt: skip


@pytest.mark.parametrize("name", list(LOOPS))
def test_a_looping_template_is_one_error_line_and_leaves_nothing(tmp_path, capsys, monkeypatch,
                                                                name):  # fmt: skip
    import axplug_chat.template

    monkeypatch.setattr(axplug_chat.template, "RENDER_SECONDS", 0.5)
    source, message = LOOPS[name]
    (tmp_path / "loop.jinja").write_text(source)
    (tmp_path / "chats.jsonl").write_text(json.dumps(CHATS[0]) + "\n")
    argv = ["prepare-chat", str(tmp_path / "chats.jsonl"), "--tokenizer", "bytes", "--output",
            str(tmp_path / "out"), "--chat-template", str(tmp_path / "loop.jinja"),
            "--workers", "1"]  # fmt: skip
    assert main(argv) == 2  # a bad input, named
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and len(err.splitlines()) == 1, err
    assert message in err and "Traceback" not in err
    assert not (tmp_path / "out" / "meta.json").exists()


def test_a_render_stops_within_its_budget_and_the_next_one_runs(monkeypatch):
    import time

    import axplug_chat.template
    from axplug_chat.template import ChatTemplate

    monkeypatch.setattr(axplug_chat.template, "RENDER_SECONDS", 0.5)
    start = time.monotonic()
    with pytest.raises(ValueError, match="rendering took over 0.5 s"):
        ChatTemplate(LOOPS["nested loops"][0]).render(CHATS[0]["messages"])
    assert time.monotonic() - start < 5  # stopped at the budget, not at 10**10 iterations
    fine = ChatTemplate(CHATML).render(CHATS[0]["messages"])  # the deadline was put back
    assert fine.startswith("<|im_start|>")
