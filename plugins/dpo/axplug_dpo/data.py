"""Preference data: records -> (chosen, rejected) documents, and the input that pairs them."""

from __future__ import annotations

from typing import Any

from axplug_chat import ChatTemplate, conversation, rendered_segments

from axplug.api.config import config_class
from axplug.api.data import TokenFileInput

__all__ = ["PreferenceEncoder", "PreferenceInput", "REFERENCE"]

REFERENCE = "reference_logps"  # the token values `dpo-reference` writes


def _reply(value: Any, what: str) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], dict):
        return _reply(value[0], what)
    raise ValueError(f"`{what}` must be a string or one assistant message")


class PreferenceEncoder:
    """A `DocumentEncoder` of `{"prompt", "chosen", "rejected"}` records: the prompt a string
    (a user turn) or a list of messages, each response a string or an assistant message. Each
    record is two documents, chosen then rejected, the loss mask on the response only.
    `template=None` (plain): prompt text then response text and EOS, no chat template."""

    field = "*"

    def __init__(self, template: ChatTemplate | None):
        self.template = template

    def settings(self) -> dict:
        source = None if self.template is None else self.template.source
        return {"format": "preferences", "chat_template": source}

    def meta(self) -> dict:
        if self.template is None:
            return {"preferences": True}
        origin = {"origin": self.template.origin, "file": "chat_template.jinja"}
        return {"preferences": True, "chat_template": origin}

    def files(self) -> dict[str, str]:
        return {} if self.template is None else {"chat_template.jinja": self.template.source}

    def encode(self, tokenizer: Any, record: Any) -> list[tuple[list[int], list[int]]]:
        if not isinstance(record, dict) or not {"prompt", "chosen", "rejected"} <= set(record):
            raise ValueError("needs `prompt`, `chosen` and `rejected`")
        prompt = record["prompt"]
        out = []
        for key in ("chosen", "rejected"):
            reply = _reply(record[key], key)
            if self.template is None:
                if not isinstance(prompt, str):
                    raise ValueError("`prompt` must be a string for plain (non-chat) pairs")
                head = tokenizer.encode(prompt)
                tail = tokenizer.encode(reply) + ([] if tokenizer.eos_id is None
                                                  else [tokenizer.eos_id])  # fmt: skip
                out.append((head + tail, [0] * len(head) + [1] * len(tail)))
                continue
            turns = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
            messages = conversation({"messages": [*turns, {"role": "assistant", "content": reply}]})
            ids, mask = [], []
            for text, trained in rendered_segments(self.template, messages, "last"):
                piece = tokenizer.encode(text)
                ids += piece
                mask += [int(trained)] * len(piece)
            out.append((ids, mask))
        return out


class PreferenceInput(TokenFileInput):
    """A prepared preference directory (`axplug prepare-preferences`) as batches of pairs: each
    row one response, rows alternating chosen and rejected, a pair never split or shuffled
    apart; with the reference log-probabilities `dpo-reference` wrote (`reference_logps`)."""

    @config_class
    class Config(TokenFileInput.Config):
        rows: str = "documents"
        group: int = 2
        packing: bool = False

    def __init__(self, cfg: Config):
        if (cfg.rows, cfg.group, cfg.packing) != ("documents", 2, False):
            raise cfg.field_error("group", "preferences are read as pairs: keep rows='documents', "
                                  "group=2 and packing=False")  # fmt: skip
        super().__init__(cfg)
        if not self.meta.get("preferences"):
            raise cfg.field_error(
                "path", f"{cfg.path} is not preference data; make it with "
                "`axplug prepare-preferences`"
            )  # fmt: skip
