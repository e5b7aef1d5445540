"""Decode with the Engine's run-ahead (the next step dispatched before the current one's tokens
are read) against without it, paired in one process: llama-tiny, batch 8, 64-token prompts,
128 greedy tokens, 15 alternating rounds, tokens checked equal; prints each side's median
tok/s with min-max and the per-round ratio's median with min-max.

    python bench/run_ahead.py
"""

import statistics
import time

import jax
import numpy as np

from axplug.inference import Engine, Request, SamplingParams, ahead
from axplug.modifiers import make_modifier
from axplug.presets import preset_config

cfg = preset_config("llama-tiny").model
models = {
    "contiguous": cfg.instantiate(parent=None),
    "paged": make_modifier("paged_kv_cache:page_size=16")(cfg).instantiate(parent=None),
}
params = models["contiguous"].initialize_parameters_recursively(jax.random.PRNGKey(0))
prompts = np.random.default_rng(0).integers(0, cfg.decoder.vocab_size, (8, 64)).tolist()
real = ahead.dispatch_after


def once(eng, on):
    ahead.dispatch_after = real if on else (lambda e, p: None)
    for p in prompts:
        eng.submit(Request(p, SamplingParams(max_new_tokens=128, temperature=0)))
    eng.step()
    t = time.perf_counter()
    while eng.has_work:
        eng.step()
    d = time.perf_counter() - t
    out = {c.id: c.output_ids for c in eng.pop_finished()}
    return 8 * 127 / d, out


for name, m in models.items():
    eng = Engine(m, params, num_slots=8, max_len=192, prefix_caching=False)
    once(eng, True)
    once(eng, False)
    ratios = []
    a = []
    b = []
    for r in range(15):
        (x, o1), (y, o2) = (
            (once(eng, True), once(eng, False))
            if r % 2 == 0
            else reversed([once(eng, False), once(eng, True)])
        )
        assert sorted(o1.values()) == sorted(o2.values())
        ratios.append(x / y)
        a.append(x)
        b.append(y)
    print(
        f"{name}: run-ahead {statistics.median(a):.0f} tok/s [{min(a):.0f}-{max(a):.0f}], "
        f"synchronous {statistics.median(b):.0f} [{min(b):.0f}-{max(b):.0f}], paired ratio "
        f"median {statistics.median(ratios):.3f} [{min(ratios):.3f}-{max(ratios):.3f}]"
    )
