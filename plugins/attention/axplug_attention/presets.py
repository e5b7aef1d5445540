"""The LLaMA presets: llama-tiny (the demo's model) and the shapes of published LLaMA models
for planning (`axplug aot`), each the core's layers with this plugin's RoPE (and GQA)."""

from __future__ import annotations

from collections.abc import Callable

from axplug.config import apply_overrides
from axplug.presets import Preset, causal_lm_config, trainer_config

__all__ = ["llama_tiny", "llama2_7b", "llama2_70b", "llama3_8b", "sized_llama"]

_ATTENTION = "axplug-attention"
_ROPE = {"rope": _ATTENTION}


def _llama_tiny():
    model = causal_lm_config(vocab=256, dim=256, layers=4, heads=8, hidden=704)
    return trainer_config(model, seq_len=256, batch_size=8, lr=2e-3, steps=300, warmup=20)


def _llama2_7b():
    model = causal_lm_config(vocab=32000, dim=4096, layers=32, heads=32, hidden=11008, scan=True)
    model.compute_dtype = "bfloat16"
    return trainer_config(model, seq_len=4096, batch_size=256, lr=3e-4, steps=100_000, warmup=2000)


llama_tiny = Preset(
    "llama-tiny",
    "4-layer LLaMA recipe on bytes (RMSNorm, SwiGLU, RoPE); trains on CPU in minutes",
    _llama_tiny,
    ("rope",),
    _ROPE,
)
llama2_7b = Preset(
    "llama2-7b", "LLaMA 2 7B shapes, for planning and AOT checks", _llama2_7b, ("rope",), _ROPE
)


def sized_llama(vocab, dim, layers, heads, hidden, seq_len=4096) -> Callable:
    """A build function: llama2-7b's recipe (scanned, bfloat16 compute) at these shapes."""

    def build():
        return apply_overrides(
            _llama2_7b(),
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
