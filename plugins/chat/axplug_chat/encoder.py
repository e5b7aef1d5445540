"""Chat records -> token documents whose loss mask covers the assistant's turns."""

from __future__ import annotations

from typing import Any

from axplug_chat.template import ChatTemplate

__all__ = ["ChatEncoder", "conversation", "rendered_segments", "TRAIN_ON", "ROLES"]

TRAIN_ON = ("assistant", "all", "last")  # the turns whose tokens the loss counts
ROLES = ("system", "user", "assistant", "tool")


def conversation(record: Any) -> list[dict]:
    """The messages of a record: OpenAI-style `messages`, or a `prompt`/`completion` pair
    (a user turn and the assistant's answer); ValueError names what is wrong."""
    if not isinstance(record, dict):
        raise ValueError(f"a {type(record).__name__}, not a JSON object")
    if "messages" in record:
        messages = record["messages"]
        if not isinstance(messages, list) or not messages:
            raise ValueError("`messages` must be a non-empty list of {role, content} objects")
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or m.get("role") not in ROLES:
                raise ValueError(f"messages[{i}]: role must be one of {ROLES}")
            if isinstance(m.get("content"), list):
                raise ValueError(
                    f"messages[{i}]: content is a list of parts (text, images): "
                    "`axplug prepare-chat --images RUN` reads them; here it must be a string"
                )
            if not isinstance(m.get("content"), str):
                raise ValueError(f"messages[{i}]: content must be a string")
        return messages
    if isinstance(record.get("prompt"), str) and isinstance(record.get("completion"), str):
        return [
            {"role": "user", "content": record["prompt"]},
            {"role": "assistant", "content": record["completion"]},
        ]
    raise ValueError("needs `messages` (a list of {role, content}) or `prompt` and `completion`")


def rendered_segments(template: ChatTemplate, messages: list[dict], train_on: str):
    """[(text, trained)] whose texts join into the rendered conversation; `trained` marks
    each assistant reply (as the template renders it, end-of-turn tokens included)."""
    text = template.render(messages, add_generation_prompt=False)
    replies = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    if not replies:
        raise ValueError("no assistant turn: nothing to train on")
    if train_on == "all":
        return [(text, True)]
    if train_on == "last":
        replies = replies[-1:]
    segments, at = [], 0
    for i in replies:
        prompt = template.render(messages[:i], add_generation_prompt=True)
        upto = template.render(messages[: i + 1], add_generation_prompt=False)
        if not (upto.startswith(prompt) and text.startswith(upto) and len(prompt) >= at):
            raise ValueError(
                "the chat template does not render a conversation as its prompt followed by "
                "the reply (its text for the first turns changes with the later ones), so the "
                "assistant's tokens cannot be found; use --train-on all or another template"
            )
        segments += [(text[at : len(prompt)], False), (upto[len(prompt) :], True)]
        at = len(upto)
    segments.append((text[at:], False))
    return [(s, trained) for s, trained in segments if s]


class ChatEncoder:
    """A `DocumentEncoder` (axplug.input) of chat records: each conversation is rendered with
    the template and tokenized piece by piece, the loss mask 1 on the assistant's replies."""

    field = "*"

    def __init__(self, template: ChatTemplate, *, train_on: str = "assistant"):
        if train_on not in TRAIN_ON:
            raise ValueError(f"train_on {train_on!r}: one of {TRAIN_ON}")
        self.template, self.train_on = template, train_on

    def settings(self) -> dict:
        return {"format": "chat", "chat_template": self.template.source, "train_on": self.train_on}

    def meta(self) -> dict:
        return {
            "chat_template": {"origin": self.template.origin, "file": "chat_template.jinja"},
            "train_on": self.train_on,
        }

    def files(self) -> dict[str, str]:
        # Beside the tokenizer: `serve` on a model trained on this data finds it there.
        return {"chat_template.jinja": self.template.source}

    def tokens(self, tokenizer: Any, messages: list[dict]) -> tuple[list[int], list[int]]:
        """(ids, mask) of one conversation."""
        ids: list[int] = []
        mask: list[int] = []
        for text, trained in rendered_segments(self.template, messages, self.train_on):
            piece = tokenizer.encode(text)
            ids += piece
            mask += [int(trained)] * len(piece)
        return ids, mask

    def encode(self, tokenizer: Any, record: Any) -> list[tuple[list[int], list[int]]]:
        return [self.tokens(tokenizer, conversation(record))]
