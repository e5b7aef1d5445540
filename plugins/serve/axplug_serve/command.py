"""`axplug serve`: an OpenAI-compatible HTTP server for a trained or imported model."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from axplug.api import AxplugError, add_checkpoint_arguments, add_command
from axplug_serve.adapters import add_lora_arguments, check_lora_options
from axplug_serve.images import add_image_arguments, check_image_options

__all__ = ["add_parser", "run", "API_KEY_ENV"]

API_KEY_ENV = "AXPLUG_SERVE_API_KEY"

EPILOG = """\
examples:
  axplug serve --checkpoint runs/demo
  axplug serve --checkpoint runs/llama --port 9000 --num-slots 16 --max-len 4096
  axplug serve --checkpoint runs/demo --modifier paged_kv_cache:page_size=16,num_pages=256
  axplug serve --checkpoint runs/base --lora chat=runs/chat-lora --lora code=runs/code-lora
  axplug serve --checkpoint runs/llama --quantize int8        # 8-bit weights

then, with any OpenAI client:
  curl http://127.0.0.1:8000/v1/completions -H 'Content-Type: application/json' \\
       -d '{"model": "demo", "prompt": "HAMLET.", "max_tokens": 40}'
  python -c 'import openai; c = openai.OpenAI(base_url="http://127.0.0.1:8000/v1",
      api_key="-"); print(c.completions.create(model="demo", prompt="To be").choices[0].text)'

  axplug serve --checkpoint runs/demo --api-key "$KEY"      # clients send "Bearer $KEY"

endpoints: POST /v1/completions, POST /v1/chat/completions ("stream": true for server-sent
events; "logprobs", "echo" and vLLM's "prompt_logprobs" to score text), POST /tokenize,
POST /detokenize, GET /tokenizer_info, GET /v1/models, GET /health, GET /metrics
(Prometheus), GET /openapi.json; with --max-loras and --api-key, POST /v1/load_lora_adapter
and /v1/unload_lora_adapter. The model is named after the run directory (--model-name to
change it); a --lora adapter is a model of its own (its NAME in "model"). At most
--num-slots requests decode at once (continuous batching) and --max-queue more wait; beyond
that a request gets 429. Generation
stops at the eos ids of the Hugging Face model a run descends from, else at the tokenizer's
EOS. Chat prompts use --chat-template, else the template the run's chat data was prepared
with (axplug-chat records it in the data directory), else the tokenizer's
(tokenizer_config.json), else "role: content" lines ending in "assistant:". A
vision-language model takes image_url parts (data: URLs) in chat messages.
"""


def _port(text: str) -> int:
    try:
        port = int(text)
    except ValueError:
        port = -1
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"expected a TCP port 0-65535, got {text!r}")
    return port


def _checked_options(args: argparse.Namespace) -> None:
    """UsageError naming the first option out of its range."""
    from axplug.api.config import UsageError

    for option, value, low in (
        ("--num-slots", args.num_slots, 1),
        ("--max-queue", args.max_queue, 0),
        ("--prefill-chunk", args.prefill_chunk, 0),
        ("--prefill-devices", args.prefill_devices, 0),
    ):
        if value < low:
            raise UsageError(f"{option} {value}: must be at least {low}")
    if args.chat_template is not None and not os.path.isfile(args.chat_template):
        raise UsageError(f"--chat-template {args.chat_template}: no such file")
    if args.max_body_bytes < 1024:
        raise UsageError(f"--max-body-bytes {args.max_body_bytes}: must be at least 1024")
    if not 0 <= args.max_logprobs <= 1000:
        raise UsageError(f"--max-logprobs {args.max_logprobs}: must be in [0, 1000]")
    if any(not key for key in args.api_key):
        raise UsageError("--api-key: a key must not be empty")
    check_lora_options(args)
    check_image_options(args)


def _api_keys(args: argparse.Namespace) -> tuple[str, ...]:
    """--api-key values, then those in $AXPLUG_SERVE_API_KEY (comma-separated)."""
    from_env = [k.strip() for k in os.environ.get(API_KEY_ENV, "").split(",") if k.strip()]
    return tuple(dict.fromkeys([*args.api_key, *from_env]))


def _list(text: str) -> tuple[str, ...]:
    return tuple(item.strip() for item in text.split(",") if item.strip())


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    parser = add_command(
        subparsers,
        "serve",
        run,
        help="serve a checkpoint over HTTP with the OpenAI API",
        description="Load a model from a checkpoint and serve it with an OpenAI-compatible "
        "HTTP API: completions and chat, streamed or not, with continuous batching.",
        epilog=EPILOG,
    )
    add_checkpoint_arguments(parser)
    parser.add_argument("--host", default="127.0.0.1", help="default: 127.0.0.1 (this machine)")
    parser.add_argument("--port", type=_port, default=8000, help="default: 8000")
    parser.add_argument("--model-name", metavar="NAME", help="default: the run directory's name")
    parser.add_argument(
        "--num-slots", type=int, default=8, metavar="N", help="requests decoded at once (8)"
    )
    parser.add_argument(
        "--max-len",
        type=int,
        metavar="TOKENS",
        help="prompt + completion tokens per request (default: the longest sequence the "
        "model was trained on, over the runs it was fine-tuned from, else 2048)",
    )
    parser.add_argument(
        "--max-queue", type=int, default=64, metavar="N", help="requests waiting for a slot (64)"
    )
    parser.add_argument(
        "--prefill-chunk",
        type=int,
        default=256,
        metavar="TOKENS",
        help="prompt tokens cached per step and request, so long prompts never stall the "
        "requests decoding (256; 0: whole prompts)",
    )
    parser.add_argument(
        "--kv-cache",
        choices=["paged", "contiguous"],
        default="paged",
        help="paged (default): 16-token pages given to requests as they grow, read in place "
        "by a paged-attention kernel; contiguous: a max-len row per slot",
    )
    parser.add_argument(
        "--no-prefix-caching",
        dest="prefix_caching",
        action="store_false",
        help="prefill every prompt whole (default, paged caches: requests share the cached "
        "16-token pages of a prompt prefix another request computed: a system prompt, a "
        "conversation's history, the n choices of one request)",
    )
    parser.add_argument(
        "--speculative",
        metavar="PROPOSER",
        help="speculative decoding: each step verifies tokens a proposer guessed, with the "
        "target's tokens and distribution (`ngram[:num_tokens=4,max_n=4,min_n=2]`: prompt "
        "lookup; `draft:checkpoint=RUN[,num_tokens=4]`: a smaller model with this one's "
        "tokenizer; `axplug list --kind proposers`)",
    )
    parser.add_argument(
        "--prefill-devices",
        type=int,
        default=0,
        metavar="N",
        help="disaggregate: prefill on the first N devices, decode on the rest (0: every "
        "device does both)",
    )
    parser.add_argument(
        "--quantize",
        choices=["int8", "fp8"],
        help="serve the attention and feed-forward weights in 8 bits with a scale per output "
        "channel (weight-only: a quarter of float32's bytes; the activations stay float)",
    )
    add_lora_arguments(parser)
    parser.add_argument("--chat-template", metavar="FILE", help="a Jinja chat template")
    parser.add_argument(
        "--tool-parser",
        default="hermes",
        metavar="NAME",
        help="the format the model writes tool calls in: hermes (Hermes/Qwen <tool_call> "
        "blocks, the default template's), llama3_json, or a plugin's (axplug.tool_parsers)",
    )
    parser.add_argument(
        "--max-logprobs",
        type=int,
        default=20,
        metavar="N",
        help="most top tokens a request may ask logprobs of (20, as OpenAI's API)",
    )
    access = parser.add_argument_group("access and limits")
    access.add_argument(
        "--api-key",
        action="append",
        default=[],
        metavar="KEY",
        help=f"require 'Authorization: Bearer KEY' (repeat for several keys; also "
        f"${API_KEY_ENV}, comma-separated); default: no key",
    )
    access.add_argument(
        "--open-paths",
        type=_list,
        default=("/health", "/metrics"),
        metavar="PATHS",
        help="paths reachable without a key, comma-separated ('/health,/metrics'; '' for none)",
    )
    access.add_argument(
        "--max-body-bytes",
        type=int,
        default=8 << 20,
        metavar="N",
        help="larger request bodies get 413 before they are read (8 MiB)",
    )
    access.add_argument(
        "--strict-fields",
        action="store_true",
        help="refuse unknown request fields with 400 (default: ignore them, logged once)",
    )
    access.add_argument(
        "--allowed-origins",
        type=_list,
        default=(),
        metavar="ORIGINS",
        help="CORS: browser origins allowed to call the API, comma-separated ('*' for any); "
        "default: none",
    )
    add_image_arguments(parser)
    parser.add_argument(
        "--no-warmup",
        dest="warmup",
        action="store_false",
        help="skip compiling every prefill width at start-up (the first requests pay it)",
    )
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning"])
    return parser


def build(args: argparse.Namespace):
    """(app, settings, engine) for `args`: the model loaded, its engine warmed up."""
    from axplug_chat import trained_template

    from axplug.api.config import UsageError
    from axplug.api.run import Engine, Request, SamplingParams, find_tokenizer, load_checkpoint
    from axplug_serve.adapters import adapter_table
    from axplug_serve.app import ServerSettings, create_app
    from axplug_serve.disaggregated import DisaggregatedEngine
    from axplug_serve.images import image_prompts
    from axplug_serve.metrics import ServerMetrics
    from axplug_serve.startup import device_split, max_len_for, quantized, warm_up
    from axplug_serve.text import ChatTemplate
    from axplug_serve.worker import EngineWorker

    _checked_options(args)
    modifiers = list(args.modifier)
    if args.kv_cache == "paged":  # first, so a --modifier paged_kv_cache:... overrides it
        modifiers.insert(0, "paged_kv_cache:page_size=16")
    devices = device_split(args.prefill_devices)
    slots = len(args.lora) if args.max_loras is None else args.max_loras
    loaded = load_checkpoint(args.checkpoint, step=args.step, modifiers=modifiers,
                             devices=devices[-1],
                             merge_adapters=args.merge_adapters or slots > 0)  # fmt: skip
    if args.quantize:
        loaded = quantized(loaded, args.quantize)
    adapters = None
    if slots:
        loaded, adapters = adapter_table(loaded, args.lora, slots, args.max_lora_rank)
    tokenizer = find_tokenizer(loaded, args.checkpoint, args.tokenizer)
    stop = loaded.stop_tokens or ((tokenizer.eos_id,) if tokenizer.eos_id is not None else ())

    def engine_on(model, speculative=args.speculative):
        return Engine(
            model.model,
            model.params,
            num_slots=args.num_slots,
            max_len=max_len_for(loaded, args.max_len),
            prefill_chunk=args.prefill_chunk or None,
            max_logprobs=args.max_logprobs,
            mesh=model.mesh,
            axis_rules=model.axis_rules,
            prefix_caching=args.prefix_caching,
            speculative=speculative,
            adapter_slots=slots,
        )

    engine = engine_on(loaded)
    if len(devices) == 2:  # a second copy of the parameters on the prefill devices
        prefill = load_checkpoint(
            args.checkpoint, step=args.step, modifiers=modifiers, devices=devices[0],
            merge_adapters=args.merge_adapters,
        )  # fmt: skip
        prefill = quantized(prefill, args.quantize) if args.quantize else prefill
        engine = DisaggregatedEngine(engine_on(prefill, None), engine, decode_mesh=loaded.mesh)
    if args.warmup:
        warm_up(engine, Request, SamplingParams)
    name = args.model_name or os.path.basename(os.path.normpath(args.checkpoint))
    if name == "checkpoints":  # given the checkpoints/ subdirectory of a run
        name = os.path.basename(os.path.dirname(os.path.normpath(args.checkpoint)))
    if name in [lora for lora, _ in args.lora]:
        raise UsageError(f"--lora {name}=...: the served model is named {name!r} already; "
                         "name the adapter otherwise (or the model, --model-name)")  # fmt: skip
    settings = ServerSettings(
        model_name=name,
        tokenizer=tokenizer,
        # The template the run's chat data was rendered with, unless one is given.
        chat_template=_chat_template(
            ChatTemplate, tokenizer, args.chat_template or trained_template(loaded)
        ),
        stop_tokens=tuple(stop),
        step=loaded.step,
        api_keys=_api_keys(args),
        open_paths=args.open_paths,
        max_body_bytes=args.max_body_bytes,
        strict_fields=args.strict_fields,
        allowed_origins=args.allowed_origins,
        tool_parser=_tool_parser(args.tool_parser),
        images=image_prompts(loaded, tokenizer, args),
    )
    metrics = ServerMetrics()
    worker = EngineWorker(engine, max_waiting=args.max_queue, on_step=metrics.observe_engine)
    return create_app(worker, settings, metrics, adapters), settings, engine


def _tool_parser(name: str) -> str:
    from axplug.api import registry
    from axplug.api.config import UsageError

    if name not in (names := registry.names("tool_parsers")):
        raise UsageError(f"--tool-parser {name}: no such format; installed: {', '.join(names)}")
    return name


def _chat_template(chat_template: Any, tokenizer: Any, explicit: str | None) -> Any:
    """The ChatTemplate to use; one that does not parse is the user's to fix."""
    from axplug.api.config import UsageError

    try:
        return chat_template.for_tokenizer(tokenizer, explicit)
    except ValueError as exc:
        raise UsageError(f"--chat-template: {exc}; pass a template that parses") from exc


def _can_listen(host: str, port: int) -> str | None:
    """None when (host, port) can be bound now, else why not (checked before loading)."""
    import socket

    try:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        with socket.socket(family) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            probe.bind((host, port))
    except OSError as exc:
        return f"cannot listen on {host}:{port}: {exc.strerror or exc}"
    return None


def run(args: argparse.Namespace) -> int:
    import signal

    import uvicorn

    if problem := _can_listen(args.host, args.port):
        raise AxplugError(problem)  # the machine's state, not the options: a runtime failure
    app, settings, engine = build(args)
    cache = args.kv_cache + (" cache" if args.kv_cache == "contiguous" else " KV cache")
    chunk = f"{args.prefill_chunk}-token prefill chunks" if args.prefill_chunk else "whole prompts"
    split = f", prefill on {args.prefill_devices} device(s)" if args.prefill_devices else ""
    split += f", speculative {args.speculative}" if args.speculative else ""
    split += f", {args.quantize} weights" if args.quantize else ""
    if getattr(engine, "adapter_slots", 0):
        names = ", ".join(name for name, _ in args.lora) or "none yet"
        split += f", LoRA adapters {names} ({engine.adapter_slots} slots)"
    keys = len(settings.api_keys)
    access = f"{keys} API key(s)" if keys else "no API key"
    print(
        f"axplug serve: model {settings.model_name!r} (step {settings.step}) at "
        f"http://{args.host}:{args.port}/v1: {engine.num_slots} slots of {engine.max_len} "
        f"tokens, up to {args.max_queue} queued, {cache}, {chunk}{split}; {access}; chat "
        f"template: {settings.chat_template.origin}",
        file=sys.stderr,
        flush=True,
    )
    server = uvicorn.Server(
        uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level)
    )
    # uvicorn shuts down gracefully on SIGTERM/SIGINT, then raises the signal again with the
    # handlers it found: these make that a no-op, so a graceful stop exits 0, not 143.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)
    try:
        server.run()
    except SystemExit:  # uvicorn exits when it cannot bind (taken since the check above)
        raise AxplugError(f"cannot listen on {args.host}:{args.port}") from None
    return 0 if server.started else 1
