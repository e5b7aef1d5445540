"""`axplug generate`: continue a prompt with a trained or imported model, streaming the text."""

from __future__ import annotations

import argparse
import codecs
import json
import os
import sys
import time
from typing import Any

__all__ = ["add_parser", "run"]

EPILOG = """\
examples:
  axplug generate --checkpoint runs/demo --prompt "HAMLET." --temperature 0.8
  axplug generate --checkpoint runs/demo --prompt "To be" --temperature 0 --max-new-tokens 40
  axplug generate --checkpoint runs/llama --prompt-ids 1,15043,29892 --json
  axplug generate --checkpoint runs/demo --prompt "Go" --modifier paged_kv_cache:page_size=32

--checkpoint is a run directory of `axplug train` or `axplug import-hf` (or its checkpoints/
subdirectory); the model config comes from the checkpoint. --prompt is for byte-level models
(vocabulary 256, as the bundled presets); other models take token ids with --prompt-ids.
Text streams to stdout as it is generated; timings go to stderr.
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
    parser = subparsers.add_parser(
        "generate",
        help="sample a continuation of a prompt from a checkpoint",
        description="Load a model from a checkpoint and continue a prompt with KV-cache "
        "decoding (greedy, temperature, top-k, top-p).",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--checkpoint", required=True, metavar="DIR", help="run directory")
    parser.add_argument("--step", type=int, help="checkpoint step (default: the latest)")
    prompt = parser.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", help="prompt text (byte-level models)")
    prompt.add_argument(
        "--prompt-ids", type=_token_ids, metavar="ID,ID,...", help="prompt as token ids"
    )
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
        "--modifier",
        action="append",
        default=[],
        metavar="NAME[:k=v,...]",
        help="apply to the loaded config, e.g. paged_kv_cache (repeatable)",
    )
    parser.add_argument(
        "--json", action="store_true", help='print {"prompt_ids": [...], "output_ids": [...]}'
    )
    parser.set_defaults(run=run)
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
    """ValueError when the KV cache for `max_len` tokens cannot fit in the device's memory."""
    import jax

    shapes = jax.eval_shape(lambda: loaded.model.init_cache_state(1, max_len))
    need = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(shapes))
    have = _device_bytes()
    if have is not None and need > have:
        trained = getattr(loaded.config.input, "seq_len", None)
        hint = f"; the model was trained on {trained}-token sequences" if trained else ""
        raise ValueError(
            f"--max-new-tokens: a {max_len}-token sequence needs a {need / 2**30:.1f} GiB KV "
            f"cache, more than the device's {have / 2**30:.1f} GiB{hint}; ask for fewer tokens"
        )


def run(args: argparse.Namespace) -> int:
    from axplug.checkpoint.errors import CheckpointError
    from axplug.config import ConfigError
    from axplug.inference import Engine, Request, SamplingParams, load_checkpoint

    try:
        sampling = SamplingParams(
            max_new_tokens=args.max_new_tokens,
            temperature=args.temperature,
            top_k=args.top_k,
            top_p=args.top_p,
            stop_tokens=tuple(args.stop),
            seed=args.seed,
        )
        loaded = load_checkpoint(args.checkpoint, step=args.step, modifiers=args.modifier)
        if args.prompt is not None:
            if loaded.vocab_size != 256:
                raise ValueError(
                    f"--prompt needs a byte-level model (vocabulary 256); this one has "
                    f"{loaded.vocab_size} tokens: pass token ids with --prompt-ids"
                )
            prompt = list(args.prompt.encode("utf-8"))
        else:
            prompt = args.prompt_ids
        _check_cache_fits(loaded, len(prompt) + sampling.max_new_tokens)
        engine = Engine(
            loaded.model,
            loaded.params,
            num_slots=1,
            max_len=len(prompt) + sampling.max_new_tokens,
            mesh=loaded.mesh,
            axis_rules=loaded.axis_rules,
        )
        engine.submit(Request(prompt, sampling))
    except (CheckpointError, ConfigError, LookupError, ImportError, ValueError) as exc:
        print(f"axplug generate: error: {exc}", file=sys.stderr)
        return 1

    stream = not args.json and args.prompt is not None
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    if stream:
        sys.stdout.write(args.prompt)
        sys.stdout.flush()

    def on_token(event) -> None:
        if stream and event.token is not None:
            sys.stdout.write(decoder.decode(bytes([event.token])))
            sys.stdout.flush()

    start = time.perf_counter()
    (completion,) = engine.run(on_token)
    seconds = time.perf_counter() - start
    if args.json:
        print(json.dumps({"prompt_ids": prompt, "output_ids": completion.output_ids}))
    elif stream:
        sys.stdout.write(decoder.decode(b"", final=True) + "\n")
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
