"""`axplug prepare-chat`: tokenize chat conversations with a loss mask on the assistant's turns."""

from __future__ import annotations

import argparse
from typing import Any

from axplug.api import add_command

__all__ = ["add_parser", "run", "add_record_arguments", "prepare_records"]

EPILOG = """\
examples:
  axplug prepare-chat chats.jsonl --tokenizer runs/base --output data/chat
  axplug prepare-chat pairs.jsonl --tokenizer tok.json --chat-template chatml.jinja \\
      --output data/sft --train-on last
  axplug train --from runs/base --input "token_file:path=data/chat,rows=documents,packing=true" \\
      --modifier lora:16 --output-dir runs/chat

Each JSONL line is {"messages": [{"role": "system"|"user"|"assistant"|"tool", "content":
...}, ...]} (OpenAI's format) or {"prompt": ..., "completion": ...}. A conversation is rendered
with the model's chat template (tokenizer_config.json's `chat_template`, or chat_template.jinja
beside the tokenizer; --chat-template FILE otherwise; a plain `role: content` template when
there is none), rendered in a sandbox. The loss counts the assistant's replies only
(--train-on assistant; `last`: the final reply; `all`: every token). The data directory
records the template (chat_template.jinja, meta.json), so `axplug serve` on the fine-tuned
model applies the same one. Train with `rows=documents` so that no conversation is cut across
rows (add `packing=true` to fill rows with several).

With --images RUN (axplug-vision; RUN is an `axplug import-hf` of a vision-language model, or a
run trained from one), a user turn's content may be a list of OpenAI parts: {"type": "text",
"text": ...} and {"type": "image_url", "image_url": {"url": "data:image/png;base64,..." or a
local path, relative to the JSONL file}}. Each image becomes the model's image tokens (never
trained on) with its pixels, by RUN's preprocessor_config.json, stored beside them
(`image_pixels`), so rows and packing keep every image with its tokens:
  axplug prepare-chat vl.jsonl --tokenizer runs/llava --images runs/llava --output data/vl
  axplug train --from runs/llava --input "token_file:path=data/vl,rows=documents,packing=true" \\
      --modifier lora:within=decoder --output-dir runs/vl
"""


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    parser = add_command(
        subparsers,
        "prepare-chat",
        run,
        help="tokenize chat JSONL with a loss mask on the assistant's turns",
        description="Tokenize chat conversations into a data directory for fine-tuning.",
        epilog=EPILOG,
    )
    add_record_arguments(parser)
    parser.add_argument(
        "--train-on",
        choices=("assistant", "last", "all"),
        default="assistant",
        help="the tokens the loss counts (default: every assistant reply)",
    )
    parser.add_argument(
        "--images", metavar="RUN", help="read image parts for the vision-language model of RUN"
    )
    return parser


def add_record_arguments(parser: argparse.ArgumentParser) -> None:
    """The arguments of a command that prepares JSONL records with a chat template."""
    parser.add_argument("files", nargs="+", metavar="FILE", help="JSONL files, in order")
    parser.add_argument("--tokenizer", required=True, metavar="PATH", help="tokenizer file or dir")
    parser.add_argument("--output", required=True, metavar="DIR", help="the data directory")
    parser.add_argument("--chat-template", metavar="FILE", help="a Jinja chat template file")
    parser.add_argument("--docs-per-shard", type=int, default=10_000, help="records per shard")
    parser.add_argument("--workers", type=int, help="tokenizing processes (default: CPUs)")


def prepare_records(files, *, tokenizer, output, encoder_for, docs_per_shard=10_000,
                    workers=None, chat_template=None) -> dict:  # fmt: skip
    """prepare-data with the encoder `encoder_for(template)` built for `tokenizer`'s template
    (or the `chat_template` file); shared with preference data (axplug-dpo)."""
    import os

    from axplug.api.config import UsageError

    for flag, value in (("--workers", workers), ("--docs-per-shard", docs_per_shard)):
        if value is not None and value < 1:
            raise UsageError(f"{flag} must be >= 1, got {value}")

    from axplug.api.data import load_tokenizer, prepare_data
    from axplug_chat.template import ChatTemplate

    if chat_template is not None and not os.path.isfile(chat_template):
        raise UsageError(f"--chat-template {chat_template}: no such file")
    try:
        template = ChatTemplate.for_tokenizer(load_tokenizer(tokenizer), chat_template)
    except ValueError as e:
        raise UsageError(f"--chat-template: {e}") from None
    meta = prepare_data(files, tokenizer=tokenizer, output=output, encoder=encoder_for(template),
                        docs_per_shard=docs_per_shard, workers=workers)  # fmt: skip
    assert meta is not None  # one task: the whole directory
    return meta


def _image_chat(args: argparse.Namespace) -> Any:
    """`axplug_vision.chat`, imported only when --images asks for it."""
    from axplug.api.config import UsageError

    if "://" in args.output:
        raise UsageError("--images: --output must be a local directory")
    try:
        import axplug_vision.chat as image_chat
    except ModuleNotFoundError as e:
        if e.name not in ("axplug_vision", "axplug_vision.chat"):
            raise
        raise UsageError("--images: reading images needs axplug-vision installed") from None
    return image_chat


def run(args: argparse.Namespace) -> int:
    from axplug_chat.encoder import ChatEncoder

    images = None if args.images is None else _image_chat(args)

    def encoder_for(template: Any) -> Any:
        chat = ChatEncoder(template, train_on=args.train_on)
        return chat if images is None else images.ImageChatEncoder(chat, args.images)

    meta = prepare_records(
        args.files,
        tokenizer=args.tokenizer,
        output=args.output,
        encoder_for=encoder_for,
        docs_per_shard=args.docs_per_shard,
        workers=args.workers,
        chat_template=args.chat_template,
    )
    if images is not None:
        meta = images.store_image_pixels(args.output)
    print(
        f"wrote {args.output}: {meta['num_documents']:,} conversations, {meta['num_tokens']:,} "
        f"tokens, loss on the {args.train_on} tokens; template: {meta['chat_template']['origin']}"
    )
    return 0
