"""`axplug generate`: continue a prompt with a trained or imported model, streaming the text."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

from axplug.api import add_checkpoint_arguments, add_command

__all__ = ["add_parser", "run"]

EPILOG = """\
examples:
  axplug generate --checkpoint runs/demo --prompt "HAMLET." --temperature 0.8
  axplug generate --checkpoint runs/demo --prompt "To be" --temperature 0 --max-new-tokens 40
  axplug generate --checkpoint runs/llama --prompt-ids 1,15043,29892 --json
  axplug generate --checkpoint runs/demo --prompt "Go" --modifier paged_kv_cache:page_size=32
  axplug generate --checkpoint runs/llava --prompt "USER: <image> What is this? ASSISTANT:" \
      --image cat.png --temperature 0

--checkpoint is a run directory of `axplug train` or `axplug import-hf` (or its checkpoints/
subdirectory); the model config comes from the checkpoint. --prompt text is tokenized with
--tokenizer, else the tokenizer in the run directory (`import-hf` copies the model's), else
the one of the data the run trained on (`--input token_file`), else bytes for a 256-token
model; --prompt-ids takes token ids. Generation stops at --stop ids, else at the
`eos_token_id`s of the Hugging Face model the run was imported (or fine-tuned) from (its
config.json and generation_config.json), else at the tokenizer's EOS. Text streams to
stdout as it is generated; timings go to stderr.
"""


def _token_ids(text: str) -> list[int]:
    try:
        ids = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers such as 1,2,3, got {text!r}"
        ) from None
    if not ids:
        raise argparse.ArgumentTypeError("give at least one token id")
    return ids


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    parser = add_command(
        subparsers,
        "generate",
        run,
        help="sample a continuation of a prompt from a checkpoint",
        description="Load a model from a checkpoint and continue a prompt with KV-cache "
        "decoding (greedy, temperature, top-k, top-p).",
        epilog=EPILOG,
    )
    add_checkpoint_arguments(parser)
    prompt = parser.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", help="prompt text (tokenized: see --tokenizer)")
    prompt.add_argument(
        "--prompt-ids", type=_token_ids, metavar="ID,ID,...", help="prompt as token ids"
    )
    parser.add_argument(
        "--image", action="append", default=[], metavar="PATH",
        help="an image for a vision-language model (repeatable): the prompt's image markers "
        "(LLaVA's <image>) take them in order; a prompt without markers gets one per image "
        "before it",
    )  # fmt: skip
    parser.add_argument("--max-new-tokens", type=int, default=200, metavar="N")
    parser.add_argument(
        "--temperature", type=float, default=1.0, metavar="T", help="0: greedy (default 1.0)"
    )
    parser.add_argument("--top-k", type=int, default=0, metavar="K", help="0: off")
    parser.add_argument("--top-p", type=float, default=1.0, metavar="P", help="1: off")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--stop", type=int, action="append", default=[], metavar="ID", help="stop token id"
    )
    parser.add_argument(
        "--json", action="store_true", help='print {"prompt_ids": [...], "output_ids": [...]}'
    )
    return parser


def _device_bytes() -> int | None:
    """Memory of the first device (HBM), or of the host for CPU devices; None if unknown."""
    import jax

    stats = getattr(jax.devices()[0], "memory_stats", lambda: None)() or {}
    if "bytes_limit" in stats:
        return int(stats["bytes_limit"])
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def _check_cache_fits(loaded, max_len: int) -> None:
    """UsageError when the KV cache for `max_len` tokens cannot fit in the device's memory."""
    import jax

    from axplug.config import UsageError

    shapes = jax.eval_shape(lambda: loaded.model.init_cache_state(1, max_len))
    need = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(shapes))
    have = _device_bytes()
    if have is not None and need > have:
        from axplug.input import batch_shape

        trained = (batch_shape(loaded.config.input) or (0, None))[1]
        hint = f"; the model was trained on {trained}-token sequences" if trained else ""
        raise UsageError(
            f"--max-new-tokens: a {max_len}-token sequence needs a {need / 2**30:.1f} GiB KV "
            f"cache, more than the device's {have / 2**30:.1f} GiB{hint}; ask for fewer tokens"
        )


class _TextStream:
    """Prints the text of a growing id sequence as it grows; holds back a partial character."""

    def __init__(self, tokenizer, prompt_ids: list[int]):
        self._tok, self._ids = tokenizer, list(prompt_ids)
        self._shown = len(tokenizer.decode(self._ids))

    def push(self, token: int) -> None:
        self._ids.append(token)
        text = self._tok.decode(self._ids)
        if not text.endswith("\ufffd") and len(text) > self._shown:
            sys.stdout.write(text[self._shown :])
            sys.stdout.flush()
            self._shown = len(text)

    def close(self) -> None:
        text = self._tok.decode(self._ids)
        sys.stdout.write(text[self._shown :] + "\n")


def run(args: argparse.Namespace) -> int:
    from axplug.config import UsageError
    from axplug.inference import (
        Engine,
        Request,
        SamplingParams,
        find_tokenizer,
        load_checkpoint,
    )

    loaded = load_checkpoint(args.checkpoint, step=args.step, modifiers=args.modifier,
                             merge_adapters=args.merge_adapters)  # fmt: skip
    tokenizer = None
    if args.prompt is not None or args.tokenizer is not None:
        tokenizer = find_tokenizer(loaded, args.checkpoint, args.tokenizer)
    prompt = tokenizer.encode(args.prompt) if args.prompt is not None else args.prompt_ids
    if not prompt:
        raise UsageError("--prompt: the prompt has no tokens")
    embeddings = None
    if args.image:
        with_images = getattr(loaded.model, "prompt_with_images", None)
        if with_images is None:
            raise UsageError(
                f"--image: the model of {args.checkpoint} ({type(loaded.model).__name__}) "
                "takes no images; a vision-language model does (docs/vision.md)"
            )
        prompt, embeddings = with_images(
            loaded.params, prompt, args.image, tokenizer=tokenizer, allow_files=True,
            directories=[d for d, _ in loaded.lineage],
        )  # fmt: skip
    # --stop, else the imported model's eos ids, else the tokenizer's eos.
    stop = tuple(args.stop) or loaded.stop_tokens
    if not stop and tokenizer is not None and tokenizer.eos_id is not None:
        stop = (tokenizer.eos_id,)
    _check_cache_fits(loaded, len(prompt) + args.max_new_tokens)
    try:
        sampling = SamplingParams(
            max_new_tokens=args.max_new_tokens,
            temperature=args.temperature,
            top_k=args.top_k,
            top_p=args.top_p,
            stop_tokens=stop,
            seed=args.seed,
        )
        engine = Engine(
            loaded.model,
            loaded.params,
            num_slots=1,
            max_len=len(prompt) + sampling.max_new_tokens,
            mesh=loaded.mesh,
            axis_rules=loaded.axis_rules,
        )
        engine.submit(Request(prompt, sampling, embeddings=embeddings))
    except ValueError as exc:  # the engine's own checks of what the options ask for
        raise UsageError(str(exc)) from exc

    stream = None
    if not args.json and tokenizer is not None:
        sys.stdout.write(tokenizer.decode(prompt))
        sys.stdout.flush()
        stream = _TextStream(tokenizer, prompt)

    def on_token(event) -> None:
        if stream is not None and event.token is not None:
            stream.push(event.token)

    start = time.perf_counter()
    (completion,) = engine.run(on_token)
    seconds = time.perf_counter() - start
    if args.json:
        print(json.dumps({"prompt_ids": prompt, "output_ids": completion.output_ids}))
    elif stream is not None:
        stream.close()
    else:
        print(",".join(map(str, completion.output_ids)))
    count = len(completion.output_ids)
    print(
        f"[step {loaded.step}: {count} tokens in {seconds:.2f} s, "
        f"{count / max(seconds, 1e-9):.1f} tokens/s, first token after "
        f"{completion.time_to_first_token_s * 1e3:.0f} ms incl. compile; "
        f"stopped: {completion.finish_reason}]",
        file=sys.stderr,
    )
    return 0
