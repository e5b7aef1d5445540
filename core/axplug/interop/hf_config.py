"""Hugging Face `config.json` of a LLaMA or Mixtral checkpoint -> checked model hyperparameters."""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

from axplug.config import ConfigError

__all__ = [
    "HFImportError",
    "HFModelConfig",
    "SUPPORTED_ARCHITECTURES",
    "parse_hf_config",
    "read_hf_config",
]

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MixtralForCausalLM")

# The Hugging Face config classes' defaults for fields a config.json may leave out.
_DEFAULTS = {
    "LlamaForCausalLM": {"rope_theta": 10000.0, "rms_norm_eps": 1e-6},
    "MixtralForCausalLM": {
        "rope_theta": 1e6,
        "rms_norm_eps": 1e-5,
        "num_local_experts": 8,
        "num_experts_per_tok": 2,
        "router_aux_loss_coef": 0.001,
    },
}
_REQUIRED = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
)
# Checkpoint dtypes -> the compute dtype the imported model runs in (norms, softmax and the
# router stay float32 in axplug whatever this is).
_COMPUTE_DTYPES = {"float32": "float32", "bfloat16": "bfloat16", "float16": "bfloat16"}


class HFImportError(ConfigError):
    """A Hugging Face checkpoint that cannot be imported; the message names the field or tensor."""


@dataclasses.dataclass(frozen=True)
class HFModelConfig:
    """The hyperparameters of a supported Hugging Face causal LM, checked."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    tie_word_embeddings: bool
    compute_dtype: str
    max_position_embeddings: int | None = None
    # Llama 3 frequency scaling: {factor, low_freq_factor, high_freq_factor,
    # original_max_position_embeddings}; None: plain RoPE.
    rope_llama3: dict | None = None
    num_experts: int | None = None  # Mixtral only
    top_k: int | None = None
    router_aux_loss_coef: float = 0.0
    raw: dict = dataclasses.field(default_factory=dict, compare=False, repr=False)

    @property
    def is_moe(self) -> bool:
        return self.num_experts is not None


def read_hf_config(directory: str) -> HFModelConfig:
    """Reads and checks `directory/config.json`; unsupported fields fail, all named at once."""
    path = os.path.join(directory, "config.json")
    if not os.path.isdir(directory):
        raise HFImportError(f"{directory}: not a directory (expected a Hugging Face checkpoint)")
    try:
        with open(path, encoding="utf-8") as f:
            raw = json.load(f)
    except FileNotFoundError:
        raise HFImportError(
            f"{path}: missing; a Hugging Face checkpoint directory holds config.json and "
            "*.safetensors"
        ) from None
    except json.JSONDecodeError as exc:
        raise HFImportError(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(raw, dict):
        raise HFImportError(f"{path}: expected a JSON object, got {type(raw).__name__}")
    return parse_hf_config(raw, source=path)


def parse_hf_config(raw: dict, *, source: str = "config.json") -> HFModelConfig:
    """Checks a parsed config.json and returns its hyperparameters."""
    arch = _architecture(raw, source)
    cfg = {**_DEFAULTS[arch], **{k: v for k, v in raw.items() if v is not None}}
    missing = [name for name in _REQUIRED if name not in cfg]
    if missing:
        raise HFImportError(f"{source}: missing required field(s) {', '.join(missing)}")
    problems = _unsupported(cfg, arch)
    ints = {name: _positive_int(cfg, name, problems) for name in _REQUIRED}
    heads = ints["num_attention_heads"]
    kv_heads = _positive_int(cfg, "num_key_value_heads", problems, default=heads)
    if heads and kv_heads and heads % kv_heads:
        problems.append(
            f"num_key_value_heads={kv_heads} does not divide num_attention_heads={heads}"
        )
    head_dim = cfg.get("head_dim")
    if head_dim is None:
        if heads and ints["hidden_size"] % heads:
            problems.append(
                f"hidden_size={ints['hidden_size']} is not divisible by "
                f"num_attention_heads={heads}; set head_dim"
            )
        head_dim = ints["hidden_size"] // heads if heads else 0
    else:
        head_dim = _positive_int(cfg, "head_dim", problems)
    theta, llama3 = _rope(cfg, problems)
    experts = top_k = None
    if arch == "MixtralForCausalLM":
        experts = _positive_int(cfg, "num_local_experts", problems)
        top_k = _positive_int(cfg, "num_experts_per_tok", problems)
        if experts and top_k and top_k > experts:
            problems.append(f"num_experts_per_tok={top_k} exceeds num_local_experts={experts}")
    dtype = str(cfg.get("torch_dtype", cfg.get("dtype", "float32")))
    if dtype not in _COMPUTE_DTYPES:
        problems.append(f"torch_dtype={dtype!r} (supported: {', '.join(_COMPUTE_DTYPES)})")
    if problems:
        raise HFImportError(f"{source}: cannot import this {arch}: " + "; ".join(problems))
    max_positions = cfg.get("max_position_embeddings")
    return HFModelConfig(
        architecture=arch,
        vocab_size=ints["vocab_size"],
        hidden_size=ints["hidden_size"],
        intermediate_size=ints["intermediate_size"],
        num_layers=ints["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        rms_norm_eps=float(cfg["rms_norm_eps"]),
        rope_theta=theta,
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        compute_dtype=_COMPUTE_DTYPES[dtype],
        max_position_embeddings=int(max_positions) if max_positions else None,
        rope_llama3=llama3,
        num_experts=experts,
        top_k=top_k,
        router_aux_loss_coef=float(cfg.get("router_aux_loss_coef", 0.0)),
        raw=dict(raw),
    )


def _architecture(raw: dict, source: str) -> str:
    archs = raw.get("architectures")
    if not archs:
        by_type = {"llama": "LlamaForCausalLM", "mixtral": "MixtralForCausalLM"}
        if raw.get("model_type") in by_type:
            return by_type[raw["model_type"]]
        raise HFImportError(
            f"{source}: no 'architectures' field (and model_type={raw.get('model_type')!r}); "
            f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    if not isinstance(archs, list) or len(archs) != 1 or archs[0] not in SUPPORTED_ARCHITECTURES:
        raise HFImportError(
            f"{source}: architectures={archs!r} is not supported; supported: "
            f"{', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    return archs[0]


def _unsupported(cfg: dict, arch: str) -> list[str]:
    """One line per field whose value the axplug layers do not compute."""
    problems = []
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        problems.append(f"hidden_act={act!r} (only 'silu', i.e. SwiGLU, is supported)")
    for name, why in (
        ("attention_bias", "axplug's q/k/v/o projections of an imported model have no bias"),
        ("mlp_bias", "axplug's gate/up/down projections of an imported model have no bias"),
        ("use_sliding_window", "sliding-window attention is not imported"),
    ):
        if cfg.get(name):
            problems.append(f"{name}={cfg[name]!r} ({why})")
    if cfg.get("sliding_window") is not None:
        problems.append(
            f"sliding_window={cfg['sliding_window']!r} (sliding-window attention is not "
            "imported; only full causal attention)"
        )
    for name in ("attention_dropout", "router_jitter_noise"):
        if cfg.get(name, 0.0):
            problems.append(f"{name}={cfg[name]!r} (only 0.0 is supported)")
    if "quantization_config" in cfg:
        problems.append("quantization_config is set (quantized weights are not supported)")
    if arch == "LlamaForCausalLM" and "num_local_experts" in cfg:
        problems.append("num_local_experts is set on a LlamaForCausalLM")
    return problems


def _positive_int(cfg: dict, name: str, problems: list, default: Any = None) -> int:
    value = cfg.get(name, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        problems.append(f"{name}={value!r} (expected a positive integer)")
        return 0
    return value


def _rope(cfg: dict, problems: list) -> tuple[float, dict | None]:
    """(theta, Llama 3 scaling or None) from rope_theta + rope_scaling, or rope_parameters."""
    params = cfg.get("rope_parameters")
    if isinstance(params, dict):
        field, scaling = "rope_parameters", params
        theta = params.get("rope_theta", cfg.get("rope_theta"))
    else:
        field, scaling = "rope_scaling", cfg.get("rope_scaling")
        theta = cfg.get("rope_theta")
    if isinstance(theta, bool) or not isinstance(theta, (int, float)) or theta <= 0:
        problems.append(f"rope_theta={theta!r} (expected a positive number)")
        theta = 1.0
    if not scaling:
        return float(theta), None
    if not isinstance(scaling, dict):
        problems.append(f"{field}={scaling!r} (expected an object)")
        return float(theta), None
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return float(theta), None
    if kind != "llama3":
        problems.append(
            f"{field}.rope_type={kind!r} (supported: 'default' and 'llama3'; linear, dynamic, "
            "yarn and longrope scaling are not)"
        )
        return float(theta), None
    keys = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
    absent = [k for k in keys if not isinstance(scaling.get(k), (int, float))]
    if absent:
        problems.append(f"{field} of rope_type 'llama3' lacks {', '.join(absent)}")
        return float(theta), None
    if scaling.get("attention_factor", 1.0) != 1.0:
        problems.append(f"{field}.attention_factor={scaling['attention_factor']!r} (only 1.0)")
    return float(theta), {k: scaling[k] for k in keys}
