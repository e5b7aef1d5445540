"""The LoRA adapters a server holds over its base model: each a name clients give as `model`,
held in a slot of the model's adapter tables, loaded and unloaded while it serves."""

from __future__ import annotations

import argparse
import asyncio
import os
import threading
from typing import Any

from pydantic import BaseModel, Field

from axplug.api import AxplugError

__all__ = ["Adapters", "AdapterError", "adapter_table", "add_adapter_routes",
           "add_lora_arguments", "check_lora_options"]  # fmt: skip


class AdapterError(AxplugError, ValueError):
    """An adapter that cannot be served (named in use, unknown, of another base, no slot)."""

    exit_code = 2  # given at start-up: a mistake in what was asked

    def __init__(self, message: str, status: int = 400, param: str | None = "lora_path"):
        super().__init__(message)
        self.status, self.param = status, param


def _base_of(weights: Any, served: tuple[str, int, str | None]) -> str | None:
    """Why `weights` were not trained over the served checkpoint (dir, step, digest), or None."""
    base = weights.base
    if not base:
        return (f"{weights.run} stores its whole model, not adapters over a frozen base; "
                "serve it on its own (--merge-adapters)")  # fmt: skip
    directory, step, digest = served
    same = (base.get("digest") == digest if base.get("digest") and digest else
            os.path.realpath(base["from"]) == os.path.realpath(directory)
            and int(base["step"]) == step)  # fmt: skip
    if same:
        return None
    return (f"{weights.run} was trained over step {base['step']} of {base['from']}, not over "
            f"the served model (step {step} of {directory}): its adapters would meet another "
            "base; serve them over their own")  # fmt: skip


def adapter_table(loaded: Any, runs: list[tuple[str, str]], slots: int, rank: int | None):
    """(loaded model with adapter tables of `slots` entries, Adapters holding `runs`, each
    (name, run directory)) for `axplug serve --lora`. The tables sit on the Linears the
    adapters adapt (without any: every attention and feed-forward Linear) at the largest
    rank among them (or `rank`)."""
    from axplug_lora.table import adapted_linears, linears_of, read_adapter, with_table

    from axplug.api.checkpoint import Checkpointer, checkpoint_directory, params_digest
    from axplug.api.config import make_modifier

    weights = [(name, read_adapter(run)) for name, run in runs]
    directory = checkpoint_directory(loaded.lineage[0][0])
    with Checkpointer.default_config().set(directory=directory).instantiate() as ck:
        served = (directory, loaded.step, params_digest(ck, loaded.step))
    for _, w in weights:
        if problem := _base_of(w, served):
            raise AdapterError(problem)
    # Without adapters: the Linears the `lora` modifier adapts by default.
    linears = (linears_of([w for _, w in weights]) if weights else
               adapted_linears(make_modifier("lora")(loaded.config.model)))  # fmt: skip
    rank = rank or max((w.rank for _, w in weights), default=16)
    model_cfg, params, leaves = with_table(loaded.config.model, loaded.params, linears,
                                           slots=slots, rank=rank, mesh=loaded.mesh,
                                           axis_rules=loaded.axis_rules)  # fmt: skip
    table = loaded.with_model(model_cfg, params)
    adapters = Adapters(slots, leaves, served)
    for slot, (name, w) in enumerate(weights, start=1):
        table.params = adapters.install(table.params, name, w, slot)
    return table, adapters


class Adapters:
    """Adapter names -> slots (1 to `slots`) of the adapter tables at parameter paths `leaves`;
    `served`: the (checkpoint directory, step, digest) adapters must have been trained over."""

    def __init__(self, slots: int, leaves: set[str], served: tuple[str, int, str | None]):
        self.slots, self._leaves, self._served = slots, leaves, served
        self._lock = threading.Lock()
        self._names: dict[str, int] = {}
        self._runs: dict[str, str] = {}

    def slot(self, name: str | None) -> int | None:
        """The slot of adapter `name`, else None."""
        with self._lock:
            return self._names.get(name) if name is not None else None

    def cards(self) -> list[tuple[str, str]]:
        """(name, run) of every adapter held."""
        with self._lock:
            return sorted(self._runs.items())

    def install(self, params: Any, name: str, weights: Any, slot: int) -> Any:
        """`params` with `weights` in `slot`, now named `name`."""
        from axplug_lora.table import write_slot

        params = write_slot(params, self._leaves, slot, weights)
        with self._lock:
            self._names[name], self._runs[name] = slot, weights.run
        return params

    async def load(self, worker: Any, name: str, run: str, taken: set[str]) -> None:
        """Reads the LoRA run `run` and puts it in a free slot as `name` (`taken`: names of
        the server's models), between two engine steps."""
        from axplug_lora.table import read_adapter

        from axplug.api.checkpoint import CheckpointError
        from axplug.api.config import ConfigError

        if name in taken or self.slot(name) is not None:
            raise AdapterError(f"lora_name: {name!r} is already a model of this server", 409,
                               "lora_name")  # fmt: skip
        try:
            weights = await asyncio.to_thread(read_adapter, run)
        except (ConfigError, CheckpointError, OSError) as exc:
            raise AdapterError(f"lora_path: {exc}") from None
        if problem := _base_of(weights, self._served):
            raise AdapterError(f"lora_path: {problem}")

        def install(engine: Any) -> None:  # the engine thread, between steps
            with self._lock:
                named = set(self._names.values())
            free = [s for s in range(1, self.slots + 1)
                    if s not in named and s not in engine.adapters_in_use()]  # fmt: skip
            if not free:
                raise AdapterError(
                    f"every one of the {self.slots} adapter slots (--max-loras) holds an "
                    "adapter or serves requests; unload one first",
                    409,
                    None,
                )
            try:
                engine.params = self.install(engine.params, name, weights, free[0])
            except ConfigError as exc:
                raise AdapterError(f"lora_path: {exc}") from None

        await asyncio.wrap_future(worker.call(install))

    def unload(self, name: str) -> None:
        """Forgets `name`: new requests for it get 404; its slot is reused once the requests
        running on it are done."""
        with self._lock:
            if self._names.pop(name, None) is None:
                raise AdapterError(f"lora_name: no adapter {name!r} is loaded", 404, "lora_name")
            del self._runs[name]


class LoadAdapter(BaseModel):
    """POST /v1/load_lora_adapter's body (vLLM's)."""

    lora_name: str = Field(min_length=1, max_length=256)
    lora_path: str = Field(min_length=1, max_length=4096)


class UnloadAdapter(BaseModel):
    """POST /v1/unload_lora_adapter's body (vLLM's)."""

    lora_name: str = Field(min_length=1, max_length=256)


def add_adapter_routes(app: Any, api: Any) -> None:
    """vLLM's runtime adapter endpoints: POST /v1/load_lora_adapter {lora_name, lora_path}
    and /v1/unload_lora_adapter {lora_name}; only on a server that requires an API key."""
    from axplug_serve.protocol import APIError
    from axplug_serve.schema import responses

    def admin() -> None:
        if not api.settings.api_keys:
            raise APIError(403, "loading adapters at runtime needs a server started with "
                           "--api-key (the endpoints read server-side paths)",
                           "permission_error")  # fmt: skip

    def refused(exc: AdapterError) -> APIError:
        kind = "not_found_error" if exc.status == 404 else "invalid_request_error"
        return APIError(exc.status, str(exc), kind, exc.param)

    @app.post("/v1/load_lora_adapter", responses=responses(400, 403, 409))
    async def load_lora_adapter(body: LoadAdapter):
        admin()
        try:
            await api.adapters.load(api.worker, body.lora_name, body.lora_path,
                                    {api.settings.model_name})  # fmt: skip
        except AdapterError as exc:
            raise refused(exc) from None
        return next(card for card in api.model_cards() if card["id"] == body.lora_name)

    @app.post("/v1/unload_lora_adapter", responses=responses(403, 404))
    async def unload_lora_adapter(body: UnloadAdapter):
        admin()
        try:
            api.adapters.unload(body.lora_name)
        except AdapterError as exc:
            raise refused(exc) from None
        return {"id": body.lora_name, "object": "model", "deleted": True}


def _lora(text: str) -> tuple[str, str]:
    name, sep, run = text.partition("=")
    if not (sep and name.strip() and run.strip()):
        raise argparse.ArgumentTypeError(f"expected NAME=RUN, got {text!r}")
    return name.strip(), run.strip()


def add_lora_arguments(parser: Any) -> None:
    """`axplug serve`'s LoRA options."""
    loras = parser.add_argument_group("LoRA adapters")
    loras.add_argument(
        "--lora",
        action="append",
        default=[],
        type=_lora,
        metavar="NAME=RUN",
        help="serve the LoRA run RUN (trained over this checkpoint) as model NAME beside the "
        "base; requests for different adapters share a batch (repeat for several)",
    )
    loras.add_argument(
        "--max-loras",
        type=int,
        metavar="N",
        help="adapter slots, for --lora and runtime loading (POST /v1/load_lora_adapter, "
        "with --api-key); default: the --lora count, 0 without one",
    )
    loras.add_argument(
        "--max-lora-rank",
        type=int,
        metavar="R",
        help="the largest rank a slot takes (default: the largest --lora's, else 16)",
    )


def check_lora_options(args: Any) -> None:
    """UsageError naming a LoRA option that cannot work."""
    from axplug.api.config import UsageError

    if args.max_loras is not None and args.max_loras < len(args.lora):
        raise UsageError(f"--max-loras {args.max_loras}: fewer slots than the {len(args.lora)} "
                         "--lora adapters")  # fmt: skip
    if args.max_lora_rank is not None and args.max_lora_rank < 1:
        raise UsageError(f"--max-lora-rank {args.max_lora_rank}: must be at least 1")
    if (args.lora or args.max_loras) and args.prefill_devices:
        raise UsageError("--lora and --max-loras do not combine with --prefill-devices yet")
    if len(names := [name for name, _ in args.lora]) != len(set(names)):
        raise UsageError(f"--lora: the name {max(names, key=names.count)!r} is given twice")
