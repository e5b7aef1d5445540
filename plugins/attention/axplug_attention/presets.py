"""Full-size shapes of published LLaMA models for planning (`axplug aot`): the core's
llama2-7b recipe at other sizes, with this plugin's GQA and RoPE settings."""

from __future__ import annotations

from collections.abc import Callable

from axplug.config import apply_overrides
from axplug.presets import Preset, resolve_preset

__all__ = ["llama2_70b", "llama3_8b", "sized_llama"]

_ATTENTION = "axplug-attention"


def sized_llama(vocab, dim, layers, heads, hidden, seq_len=4096) -> Callable:
    """A build function: llama2-7b's recipe (scanned, bfloat16 compute) at these shapes."""

    def build():
        return apply_overrides(
            resolve_preset("llama2-7b").build(),
            [
                f"model.decoder.vocab_size={vocab}",
                f"model.decoder.dim={dim}",
                f"model.decoder.transformer.num_layers={layers}",
                f"model.decoder.transformer.layer.attention.num_heads={heads}",
                f"model.decoder.transformer.layer.feed_forward.hidden_dim={hidden}",
                f"input.seq_len={seq_len}",
            ],
        )

    return build


llama2_70b = Preset(
    "llama2-70b",
    "LLaMA 2 70B shapes (GQA, 8 kv heads)",
    sized_llama(32000, 8192, 80, 64, 28672),
    ("rope", "gqa:num_kv_heads=8"),
    {"rope": _ATTENTION, "gqa": _ATTENTION},
)
llama3_8b = Preset(
    "llama3-8b",
    "LLaMA 3 8B shapes (GQA, rope theta 500k, 128k vocab)",
    sized_llama(128256, 4096, 32, 32, 14336, seq_len=8192),
    ("rope:theta=500000.0", "gqa:num_kv_heads=8"),
    {"rope": _ATTENTION, "gqa": _ATTENTION},
)
