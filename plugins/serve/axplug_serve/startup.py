"""How `axplug serve` sets up its engine: the longest sequence it serves, the devices prefill
and decode run on, and compiling every program before the first request."""

from __future__ import annotations

import sys

__all__ = ["device_split", "max_len_for", "quantized", "trained_len", "warm_up"]


def trained_len(loaded) -> int | None:
    """The longest sequence the model was trained on: over the run and every run it was
    initialized from (a fine-tune's shorter rows do not shorten the model), capped by a
    learned position table's size."""
    lengths = [getattr(loaded.config.input, "seq_len", None)]
    for _, metadata in loaded.lineage:
        lengths.append(((metadata.get("config") or {}).get("input") or {}).get("seq_len"))
    known = [n for n in lengths if isinstance(n, int) and not isinstance(n, bool) and n > 1]
    longest = max(known, default=None)
    table = getattr(getattr(loaded.config.model, "decoder", None), "max_positions", None)
    if isinstance(table, int) and table > 1:
        longest = table if longest is None else min(longest, table)
    return longest


def max_len_for(loaded, explicit: int | None) -> int:
    """The engine's max_len: `explicit` (--max-len, warned about past `trained_len`), else
    the length the model trained on (2048 when unknown)."""
    from axplug.api.config import UsageError

    trained = trained_len(loaded)
    if explicit is None:
        return trained or 2048
    if explicit < 2:
        raise UsageError(f"--max-len {explicit}: must be at least 2")
    if trained is not None and explicit > trained:
        print(
            f"axplug serve: warning: --max-len {explicit} is longer than the {trained}-token "
            "sequences the model was trained on; quality past that is not known",
            file=sys.stderr,
        )
    return explicit


def warm_up(engine, request, sampling_params) -> None:
    """Compiles the decode step and every prefill width now, not in the first requests (with
    adapter slots, also the programs of batches with an adapter row)."""
    limit = min(engine.max_len, engine.prefill_chunk)
    lengths, width = [1, 2], engine.min_prefill_len  # 1: the decode width; 2: the smallest
    while width < limit:
        lengths.append(width + 1)  # the next bucket up
        width *= 2
    for adapter in range(1 + bool(getattr(engine, "adapter_slots", 0))):

        def greedy(prompt: list[int], tokens: int, adapter: int = adapter):
            return request(prompt, sampling_params(max_new_tokens=tokens, temperature=0),
                           adapter=adapter)  # fmt: skip

        for length in lengths:  # each prefills at its width, then decodes a token (width 1)
            engine.submit(greedy([0] * length, 2))
            engine.run()
        # A prompt longer than a chunk: its later chunks prefill beside a decoding row.
        if engine.prefill_chunk < engine.max_len - 2:
            engine.submit(greedy([0], 3))
            engine.submit(greedy([0] * (engine.prefill_chunk + 1), 1))
            engine.run()


def quantized(loaded, fmt: str):
    """`loaded` with its attention and feed-forward weights in `fmt` (axplug-quantize's
    weight-only int8 or fp8)."""
    from axplug_quantize import quantize_weights

    return loaded.with_model(
        *quantize_weights(
            loaded.config.model, loaded.params, fmt, mesh=loaded.mesh, axis_rules=loaded.axis_rules
        )
    )


def device_split(prefill: int) -> list[list | None]:
    """[None] (the first device), or [prefill devices, decode devices] for --prefill-devices."""
    import jax

    from axplug.api.config import UsageError

    devices = jax.devices()
    if prefill <= 0:
        return [None]  # as `axplug generate`
    if prefill >= len(devices):
        raise UsageError(
            f"--prefill-devices {prefill}: this machine has {len(devices)} device(s) and the "
            "decode side needs at least one (on CPU, XLA_FLAGS="
            "--xla_force_host_platform_device_count=N makes N devices)"
        )
    return [devices[:prefill], devices[prefill:]]
