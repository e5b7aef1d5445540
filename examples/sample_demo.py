"""Samples bytes from the latest checkpoint of a run: `python sample_demo.py RUN_DIR [PROMPT]`.

A full forward pass per token over a fixed window (no KV cache): small and obviously right.
"""

import sys

import jax
import jax.numpy as jnp
import numpy as np

from axplug.checkpoint import Checkpointer
from axplug.config import from_dict
from axplug.context import functional


def load(run_dir: str):
    directory = f"{run_dir.rstrip('/')}/checkpoints"
    with Checkpointer.default_config().set(directory=directory).instantiate() as checkpointer:
        metadata = checkpointer.metadata(checkpointer.latest_step())
    trainer = from_dict(metadata["config"]).clone(compilation_cache_dir=None).instantiate()
    step, state, _ = trainer.checkpointer.restore(target=trainer.abstract_state)
    return trainer, step, state["params"]


def sample(
    model, params, prompt: bytes, *, window: int, new_tokens: int, temperature: float, seed: int = 0
) -> bytes:
    @jax.jit
    def next_token(params, ids, length, key):
        logits = functional(
            model, prng_key=None, state=params, inputs=(ids,), is_training=False, method="predict"
        )[0]
        last = logits[0, length - 1] / temperature
        return jax.random.categorical(key, last)

    tokens = list(prompt)
    key = jax.random.PRNGKey(seed)
    for _ in range(new_tokens):
        context = tokens[-window:]
        ids = np.zeros((1, window), np.int32)
        ids[0, : len(context)] = context
        key, sub = jax.random.split(key)
        tokens.append(int(next_token(params, jnp.asarray(ids), len(context), sub)))
    return bytes(tokens)


def main():
    run_dir = sys.argv[1]
    prompt = (sys.argv[2] if len(sys.argv) > 2 else "HAMLET.\n").encode()
    trainer, step, params = load(run_dir)
    window = trainer.config.input.seq_len
    text = sample(trainer.model, params, prompt, window=window, new_tokens=300, temperature=0.8)
    print(f"--- sample from step {step} of {run_dir} ---")
    print(text.decode("utf-8", errors="replace"))


if __name__ == "__main__":
    main()
