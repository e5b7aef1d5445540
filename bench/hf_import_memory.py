"""Peak host memory of `axplug import-hf` on a synthetic multi-GB sharded checkpoint, against
the goal of 1.5 x (largest shard + this host's parameters).

    python bench/hf_import_memory.py [--gib 2] [--shard-mib 512]

Writes a LLaMA-layout checkpoint of float32 random tensors (about --gib GiB, shards of at
most --shard-mib MiB), then runs the import in a child process and reads its peak resident
memory (`ru_maxrss`); a second child that imports jax and axplug and starts the CPU backend
gives the baseline that is subtracted. Prints the ratio to the goal's budget.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

import numpy as np

_CHILD = """
import resource, sys
import jax, jax.numpy as jnp
jnp.zeros(1).block_until_ready()
from axplug.interop import import_hf
if sys.argv[1] != "-":
    import_hf(sys.argv[1], sys.argv[2])
print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
"""


def write_checkpoint(directory: str, gib: float, shard_mib: int) -> tuple[int, int]:
    """(largest shard bytes, parameter bytes) of a LLaMA-layout checkpoint of ~gib GiB."""
    from safetensors.numpy import save_file

    dim, hidden, vocab, heads = 2048, 5632, 32000, 16
    per_layer = 4 * dim * dim + 3 * dim * hidden + 2 * dim
    layers = max(1, int((gib * 2**30 / 4 - 2 * vocab * dim) // per_layer))
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": vocab,
        "hidden_size": dim, "intermediate_size": hidden, "num_hidden_layers": layers,
        "num_attention_heads": heads, "num_key_value_heads": heads, "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0, "torch_dtype": "float32", "max_position_embeddings": 2048,
    }  # fmt: skip
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(config, f)
    rng = np.random.default_rng(0)
    shapes = {"model.embed_tokens.weight": (vocab, dim), "lm_head.weight": (vocab, dim),
              "model.norm.weight": (dim,)}  # fmt: skip
    for i in range(layers):
        p = f"model.layers.{i}"
        for name in "qkvo":
            shapes[f"{p}.self_attn.{name}_proj.weight"] = (dim, dim)
        shapes[f"{p}.mlp.gate_proj.weight"] = shapes[f"{p}.mlp.up_proj.weight"] = (hidden, dim)
        shapes[f"{p}.mlp.down_proj.weight"] = (dim, hidden)
        shapes[f"{p}.input_layernorm.weight"] = shapes[f"{p}.post_attention_layernorm.weight"] = (
            dim,
        )
    shards, shard, size, weight_map = [], {}, 0, {}
    for name, shape in shapes.items():
        nbytes = int(np.prod(shape)) * 4
        if shard and size + nbytes > shard_mib * 2**20:
            shards.append(shard)
            shard, size = {}, 0
        shard[name], size = shape, size + nbytes
    shards.append(shard)
    largest = 0
    for i, names in enumerate(shards, 1):
        file = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        arrays = {n: rng.standard_normal(s, dtype=np.float32) * 0.02 for n, s in names.items()}
        largest = max(largest, sum(a.nbytes for a in arrays.values()))
        save_file(arrays, os.path.join(directory, file), {"format": "pt"})
        weight_map.update(dict.fromkeys(names, file))
        del arrays
    with open(os.path.join(directory, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    total = sum(int(np.prod(s)) * 4 for s in shapes.values())
    return largest, total


def _peak(*args: str) -> int:
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    out = subprocess.run([sys.executable, "-c", _CHILD, *args], capture_output=True, text=True,
                         env=env, check=True)  # fmt: skip
    return int(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=2.0)
    parser.add_argument("--shard-mib", type=int, default=512)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        src, out = os.path.join(tmp, "hf"), os.path.join(tmp, "run")
        os.makedirs(src)
        largest, params = write_checkpoint(src, args.gib, args.shard_mib)
        baseline = _peak("-", "-")
        peak = _peak(src, out)
    budget = 1.5 * (largest + params)
    used = peak - baseline
    gib = 2**30
    print(f"checkpoint {params / gib:.2f} GiB in shards of <= {largest / gib:.2f} GiB")
    print(f"peak RSS {peak / gib:.2f} GiB, baseline (jax + axplug) {baseline / gib:.2f} GiB")
    print(f"import used {used / gib:.2f} GiB = {used / (largest + params):.2f} x "
          f"(largest shard + parameters); goal <= 1.5 x")  # fmt: skip
    print(f"import-memory/goal ratio: {used / budget:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
