"""The LLaMA presets: llama-tiny (the demo's model) and the shapes of published LLaMA models
for planning (`axplug aot`), each the core's layers with this plugin's RoPE (and GQA)."""

from __future__ import annotations

from collections.abc import Callable

from axplug.api.config import Preset, causal_lm_config, trainer_config

__all__ = ["llama_tiny", "llama2_7b", "llama2_70b", "llama3_8b", "sized_llama"]

_ATTENTION = "axplug-attention"
_ROPE = {"rope": _ATTENTION}


def _llama_tiny():
    model = causal_lm_config(vocab=256, dim=256, layers=4, heads=8, hidden=704)
    return trainer_config(model, seq_len=256, batch_size=8, lr=2e-3, steps=300, warmup=20)


llama_tiny = Preset(
    "llama-tiny",
    "4-layer LLaMA recipe on bytes (RMSNorm, SwiGLU, RoPE); trains on CPU in minutes",
    _llama_tiny,
    ("rope",),
    _ROPE,
)


def sized_llama(vocab, dim, layers, heads, hidden, seq_len=4096) -> Callable:
    """A build function: the LLaMA 2 recipe (scanned, bfloat16 compute, 256 rows) at these
    shapes."""

    def build():
        model = causal_lm_config(
            vocab=vocab, dim=dim, layers=layers, heads=heads, hidden=hidden, scan=True
        )
        model.compute_dtype = "bfloat16"
        return trainer_config(
            model, seq_len=seq_len, batch_size=256, lr=3e-4, steps=100_000, warmup=2000
        )

    return build


llama2_7b = Preset(
    "llama2-7b",
    "LLaMA 2 7B shapes, for planning and AOT checks",
    sized_llama(32000, 4096, 32, 32, 11008),
    ("rope",),
    _ROPE,
)
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
