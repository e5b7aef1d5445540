"""Many LoRA adapters in one batch: decode speed of a mixed batch against the base alone.

    python bench/serve.py lora [--batch 8] [--rank 16] [--adapters 2] [--new-tokens 64]

llama-tiny with random parameters, a paged cache, greedy. Each round decodes `--batch`
prompts of 32 tokens for `--new-tokens` tokens, interleaved: the base model alone (no adapter
tables: what a server without --lora runs); the table model with every row on the base (its
step without the side input: the same program as the base's); every row on one adapter;
the rows spread over the base and `--adapters` adapters (the mixed batch); and one adapter
merged into the weights (what a server per adapter runs). The adapters are random, of rank
`--rank`, on every attention and feed-forward Linear. Prints decode tokens/s (median,
min-max) and the ratio to the base alone.
"""

from __future__ import annotations

import statistics
import time

import jax
import numpy as np

from axplug.inference import Engine, Request, SamplingParams
from axplug.layers import fold_layers
from axplug.mesh import DEFAULT_AXIS_RULES, MeshBuilder
from axplug.modifiers import make_modifier
from axplug.presets import preset_config


def _decode(engine, prompts, adapters, new_tokens) -> float:
    """Decode tokens/s of one batch (after the step that prefills it)."""
    greedy = SamplingParams(max_new_tokens=new_tokens, temperature=0)
    for prompt, adapter in zip(prompts, adapters, strict=True):
        engine.submit(Request(prompt, greedy, adapter=adapter))
    engine.step()
    start = time.perf_counter()
    while engine.has_work:
        engine.step()
    seconds = time.perf_counter() - start
    assert all(len(c.output_ids) == new_tokens for c in engine.pop_finished())
    return len(prompts) * (new_tokens - 1) / seconds


def _random_lora(cfg, base, rank: int, seed: int):
    """(config, parameters) of the model with a random rank-`rank` LoRA over `base`."""
    lora_cfg = make_modifier(f"lora:rank={rank},alpha={rank}")(cfg)
    model = lora_cfg.instantiate(parent=None)
    params = model.initialize_parameters_recursively(jax.random.PRNGKey(seed))
    keys = iter(jax.random.split(jax.random.PRNGKey(seed + 1), 1024))

    def fill(tree, known):  # the base's parameters; lora_b random, so the adapter does something
        out = {}
        for name, value in tree.items():
            if isinstance(value, dict):
                out[name] = fill(value, known.get(name, {}))
            elif name == "lora_b":
                out[name] = 0.05 * jax.random.normal(next(keys), value.shape, value.dtype)
            else:
                out[name] = known.get(name, value)
        return out

    return lora_cfg, fill(params, base)


def bench_lora(args) -> None:
    from axplug_lora import lora_weights
    from axplug_lora.table import adapted_linears, with_table, write_slot

    preset = preset_config(args.preset, overrides=args.set)
    cfg = make_modifier("paged_kv_cache:page_size=16")(preset.model)
    model = cfg.instantiate(parent=None)
    base = model.initialize_parameters_recursively(jax.random.PRNGKey(0))
    loras = [_random_lora(cfg, base, args.rank, 10 * (i + 1)) for i in range(args.adapters)]
    mesh = MeshBuilder.default_config().set(mesh_shape=(1,), axis_names=("fsdp",))
    mesh = mesh.instantiate().build(jax.devices()[:1])
    table_cfg, params, leaves = with_table(cfg, base, adapted_linears(loras[0][0]),
                                           slots=args.adapters, rank=args.rank, mesh=mesh,
                                           axis_rules=DEFAULT_AXIS_RULES)  # fmt: skip
    for slot, (lora_cfg, lora) in enumerate(loras, start=1):
        params = write_slot(params, leaves, slot, lora_weights(lora_cfg, lora))
    merged_cfg, merged = fold_layers(*loras[0])
    table = table_cfg.instantiate(parent=None)
    kw = dict(num_slots=args.batch, max_len=32 + args.new_tokens, prefix_caching=False)
    engines = {
        "base alone": (Engine(model, base, **kw), 0),
        "table, base rows": (Engine(table, params, adapter_slots=args.adapters, **kw), 0),
        "one adapter": (Engine(table, params, adapter_slots=args.adapters, **kw), 1),
        "mixed": (Engine(table, params, adapter_slots=args.adapters, **kw), None),
        "merged adapter": (Engine(merged_cfg.instantiate(parent=None), merged, **kw), 0),
    }
    prompts = np.random.default_rng(0).integers(0, cfg.decoder.vocab_size, (args.batch, 32))
    prompts = prompts.tolist()
    mixed = [i % (args.adapters + 1) for i in range(args.batch)]
    print(
        f"{args.preset} (random parameters), paged cache, greedy, batch {args.batch}, "
        f"{args.adapters} adapters of rank {args.rank} on every attention and feed-forward "
        f"Linear, {args.new_tokens} new tokens, jax {jax.__version__} on "
        f"{jax.devices()[0].platform}; median [min-max] of {args.rounds} rounds"
    )

    def rows(adapter):
        return mixed if adapter is None else [adapter] * args.batch

    for engine, adapter in engines.values():  # warm-up: compile every program
        _decode(engine, prompts, rows(adapter), args.new_tokens)
    tps: dict[str, list[float]] = {name: [] for name in engines}
    for r in range(args.rounds):
        for name in engines if r % 2 == 0 else reversed(engines):
            engine, adapter = engines[name]
            tps[name].append(_decode(engine, prompts, rows(adapter), args.new_tokens))
    base_tps = statistics.median(tps["base alone"])
    print(f"{'batch':<20}{'rows: adapter':>22}{'decode tok/s':>14}{'min-max':>14}{'x base':>9}")
    for name, (_, adapter) in engines.items():
        median = statistics.median(tps[name])
        spread = f"{min(tps[name]):.0f}-{max(tps[name]):.0f}"
        shown = ",".join(map(str, rows(adapter))) if adapter is None else str(adapter)
        print(f"{name:<20}{shown:>22}{median:>14.0f}{spread:>14}{median / base_tps:>9.3f}")


def add_parser(sub) -> None:
    p = sub.add_parser("lora", help="many LoRA adapters in one batch against the base")
    p.add_argument("--preset", default="llama-tiny")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--adapters", type=int, default=2)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--set", action="append", default=[], metavar="PATH=VALUE",
                   help="a preset override, e.g. model.dtype='bfloat16'")  # fmt: skip
