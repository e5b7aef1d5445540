"""The cost of `--modifier batch_invariant` (axplug-batch-invariant) in the Engine: llama-tiny,
paged cache, batch 8, 64-token prompts, 64 greedy tokens with logprobs, plain layers against
batch-invariant ones, interleaved rounds; prints medians with min-max and the ratios.

    python bench/batch_invariant.py [--rounds 5]
"""

import argparse
import statistics
import time

import jax
import numpy as np

from axplug.inference import Engine, Request, SamplingParams
from axplug.modifiers import make_modifier
from axplug.presets import preset_config

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--rounds", type=int, default=5)
args = parser.parse_args()
cfg = make_modifier("paged_kv_cache:page_size=16")(preset_config("llama-tiny").model)
models = {
    "plain": cfg.instantiate(parent=None),
    "batch_invariant": make_modifier("batch_invariant")(cfg).instantiate(parent=None),
}
params = models["plain"].initialize_parameters_recursively(jax.random.PRNGKey(0))
prompts = np.random.default_rng(0).integers(0, cfg.decoder.vocab_size, (8, 64)).tolist()
NEW_TOKENS = 64
engines = {
    k: Engine(m, params, num_slots=8, max_len=192, prefix_caching=False) for k, m in models.items()
}


def once(eng):
    for p in prompts:
        eng.submit(Request(p, SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0, logprobs=1)))
    t = time.perf_counter()
    eng.step()
    pre = time.perf_counter() - t
    t = time.perf_counter()
    while eng.has_work:
        eng.step()
    dec = time.perf_counter() - t
    eng.pop_finished()
    return pre, len(prompts) * (NEW_TOKENS - 1) / dec


res = {k: [] for k in engines}
for e in engines.values():
    once(e)
for r in range(args.rounds):
    for k, e in engines.items() if r % 2 == 0 else reversed(engines.items()):
        res[k].append(once(e))
for k, v in res.items():
    pre, tps = [a * 1e3 for a, _ in v], [b for _, b in v]
    print(
        f"{k}: TTFT {statistics.median(pre):.1f} ms [{min(pre):.1f}-{max(pre):.1f}], "
        f"decode {statistics.median(tps):.0f} tok/s [{min(tps):.0f}-{max(tps):.0f}]"
    )
med = {
    k: (statistics.median(a for a, _ in v), statistics.median(b for _, b in v))
    for k, v in res.items()
}
print(
    f"batch_invariant / plain: TTFT x{med['batch_invariant'][0] / med['plain'][0]:.2f}, "
    f"decode tok/s x{med['batch_invariant'][1] / med['plain'][1]:.2f}"
)
