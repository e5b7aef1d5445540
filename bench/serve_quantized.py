"""Weight-only int8 / fp8 serving against the float model: bytes, logit error, greedy tokens
and decode speed.

    python bench/serve.py quantized [--preset llama-tiny] [--batch 8] [--new-tokens 64]
    python bench/serve.py quantized --checkpoint RUN        (a trained model: its own weights)

Random parameters of `--preset` (or a checkpoint's), a paged cache, greedy. Prints, for
float, int8 and fp8: the parameters' bytes, the largest logit error over 8 rows of 64 random
tokens (against the float model, with the logits' standard deviation), the share of greedy
tokens equal to the float model's over `--batch` prompts of 32 tokens, and decode tokens/s
(median, min-max over `--rounds` interleaved rounds) with its ratio to float's.
"""

from __future__ import annotations

import statistics
import time

import jax
import numpy as np

from axplug.inference import Engine, Request, SamplingParams


def _models(args):
    """{name: LoadedModel} for float, int8 and fp8."""
    from axplug_quantize import quantize_weights

    from axplug.inference.loading import LoadedModel, load_checkpoint
    from axplug.mesh import DEFAULT_AXIS_RULES, MeshBuilder
    from axplug.modifiers import make_modifier
    from axplug.presets import preset_config

    paged = "paged_kv_cache:page_size=16"
    if args.checkpoint:
        base = load_checkpoint(args.checkpoint, modifiers=[paged])
    else:
        cfg = preset_config(args.preset, overrides=args.set)
        cfg = cfg.clone(model=make_modifier(paged)(cfg.model))
        model = cfg.model.instantiate(parent=None, _path="model")
        params = model.initialize_parameters_recursively(jax.random.PRNGKey(0))
        mesh = MeshBuilder.default_config().set(mesh_shape=(1,), axis_names=("fsdp",))
        mesh = mesh.instantiate().build(jax.devices()[:1])
        base = LoadedModel(model, params, cfg, 0, mesh, DEFAULT_AXIS_RULES)
    out = {"float": base}
    for fmt in ("int8", "fp8"):
        out[fmt] = base.with_model(
            *quantize_weights(
                base.config.model, base.params, fmt, mesh=base.mesh, axis_rules=base.axis_rules
            )
        )
    return out


def _decode(engine, prompts, new_tokens) -> tuple[float, list[list[int]]]:
    """(decode tokens/s, greedy tokens) of one batch."""
    greedy = SamplingParams(max_new_tokens=new_tokens, temperature=0)
    for i, prompt in enumerate(prompts):
        engine.submit(Request(prompt, greedy, id=i))
    engine.step()
    start = time.perf_counter()
    while engine.has_work:
        engine.step()
    seconds = time.perf_counter() - start
    done = sorted(engine.pop_finished(), key=lambda c: c.id)
    return len(prompts) * (new_tokens - 1) / seconds, [c.output_ids for c in done]


def bench_quantized(args) -> None:
    models = _models(args)
    vocab = models["float"].vocab_size
    rng = np.random.default_rng(0)
    ids = rng.integers(0, vocab, (8, 64))
    prompts = rng.integers(0, vocab, (args.batch, 32)).tolist()
    reference = models["float"].logits(ids)
    kw = dict(num_slots=args.batch, prefix_caching=False, max_len=32 + args.new_tokens)
    engines = {name: Engine(m.model, m.params, **kw) for name, m in models.items()}
    tokens = {
        name: _decode(engine, prompts, args.new_tokens)[1] for name, engine in engines.items()
    }
    tps: dict[str, list[float]] = {name: [] for name in engines}
    for r in range(args.rounds):
        for name in engines if r % 2 == 0 else reversed(engines):
            tps[name].append(_decode(engines[name], prompts, args.new_tokens)[0])
    source = args.checkpoint or f"{args.preset} (random parameters)"
    print(f"{source}, paged cache, greedy, batch {args.batch}, {args.new_tokens} new tokens, jax "
          f"{jax.__version__} on {jax.devices()[0].platform}; median [min-max] of {args.rounds} "
          f"rounds; logits' std {reference.std():.3f}")  # fmt: skip
    print(f"{'weights':<8}{'param MiB':>11}{'x float':>9}{'max |dlogit|':>14}{'greedy =':>10}"
          f"{'decode tok/s':>14}{'min-max':>14}{'x float':>9}")  # fmt: skip
    size0 = sum(a.nbytes for a in jax.tree.leaves(models["float"].params))
    speed0 = statistics.median(tps["float"])
    for name, loaded in models.items():
        size = sum(a.nbytes for a in jax.tree.leaves(loaded.params))
        error = np.abs(loaded.logits(ids) - reference).max()
        same = np.mean([a == b for x, y in zip(tokens[name], tokens["float"], strict=True)
                        for a, b in zip(x, y, strict=True)])  # fmt: skip
        speed = statistics.median(tps[name])
        spread = f"{min(tps[name]):.0f}-{max(tps[name]):.0f}"
        print(f"{name:<8}{size / 2**20:>11.2f}{size / size0:>9.3f}{error:>14.4f}{same:>10.3f}"
              f"{speed:>14.0f}{spread:>14}{speed / speed0:>9.3f}")  # fmt: skip


def add_parser(sub) -> None:
    p = sub.add_parser("quantized", help="weight-only int8 / fp8 against the float model")
    p.add_argument("--preset", default="llama-tiny")
    p.add_argument("--checkpoint", help="a run directory (default: random parameters)")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--set", action="append", default=[], metavar="PATH=VALUE",
                   help="a preset override, e.g. model.dtype='bfloat16'")  # fmt: skip
