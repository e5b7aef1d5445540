"""Prompt records for rollouts: JSONL lines of `prompt` (text or chat messages) plus the
fields rewards read, tokenized with the model's chat template or as plain text."""

from __future__ import annotations

import json
import pathlib
from typing import Any

from axplug.api.config import ConfigFileError

__all__ = ["PromptSet", "TEMPLATES"]

TEMPLATES = ("chat", "plain")  # or a .jinja file


class PromptSet:
    """The records of `path` and their prompt token ids (`tokenizer`, `template`); a record
    longer than `max_prompt_tokens` or without a usable `prompt` is refused by its line."""

    def __init__(self, path: str, tokenizer: Any, template: str, max_prompt_tokens: int):
        file = pathlib.Path(path).expanduser()
        if not file.is_file():
            raise ConfigFileError(f"prompts: {path!r} does not exist (a JSONL file of prompts)")
        render = _renderer(tokenizer, template)
        self.records: list[dict] = []
        self.ids: list[list[int]] = []
        with file.open(encoding="utf-8") as f:
            for number, line in enumerate(f, 1):
                if not line.strip():
                    continue
                where = f"{path}:{number}"
                try:
                    record = json.loads(line)
                    ids = render(record)
                except (ValueError, TypeError) as exc:
                    raise ConfigFileError(f"{where}: {exc}") from None
                if not ids:
                    raise ConfigFileError(f"{where}: the prompt is empty")
                if len(ids) > max_prompt_tokens:
                    raise ConfigFileError(
                        f"{where}: the prompt is {len(ids)} tokens, more than the "
                        f"{max_prompt_tokens} that seq_len leaves beside max_new_tokens; raise "
                        "seq_len or shorten the prompt"
                    )
                self.records.append(record)
                self.ids.append(ids)
        if not self.records:
            raise ConfigFileError(f"prompts: {path!r} holds no prompts")

    def __len__(self) -> int:
        return len(self.records)


def _renderer(tokenizer: Any, template: str):
    """record -> prompt ids: the chat template renders messages (a string prompt is one user
    turn) ending where the assistant's reply starts; `plain` takes a string prompt as is."""
    if template == "plain":

        def plain(record: Any) -> list[int]:
            prompt = _field(record)
            if not isinstance(prompt, str):
                raise ValueError("`prompt` must be a string with template=plain")
            return ([tokenizer.bos_id] if tokenizer.bos_id is not None else []) + tokenizer.encode(
                prompt
            )

        return plain
    from axplug_chat.template import ChatTemplate

    explicit = None if template == "chat" else template
    if explicit is not None and not pathlib.Path(explicit).is_file():
        raise ConfigFileError(
            f"template: {template!r} is none of {TEMPLATES} and not a chat template file"
        )
    chat = ChatTemplate.for_tokenizer(tokenizer, explicit)

    def rendered(record: Any) -> list[int]:
        prompt = _field(record)
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
        if not isinstance(messages, list) or not all(
            isinstance(m, dict) and isinstance(m.get("content"), str) for m in messages
        ):
            raise ValueError("`prompt` must be a string or a list of {role, content} messages")
        return tokenizer.encode(chat.render(messages, add_generation_prompt=True))

    return rendered


def _field(record: Any) -> Any:
    if not isinstance(record, dict) or "prompt" not in record:
        raise ValueError("each line must be a JSON object with a `prompt`")
    return record["prompt"]
