"""`export_hf`: an axplug run of a LLaMA-shaped model (or a Mixtral, through the MoE plugin's
registered mapping) -> a Hugging Face checkpoint directory
(`config.json`, sharded safetensors with their index, the tokenizer files). The inverse of
`import_hf`: Linear weights are transposed back to [out, in], a scanned stack is unstacked."""

from __future__ import annotations

import json
import os
from typing import Any

import jax
import numpy as np

from axplug.interop.hf_config import HFImportError

__all__ = ["export_hf", "hf_config_for", "HFExportError"]


class HFExportError(HFImportError):
    """The run's model has something a Hugging Face LLaMA cannot express."""


def _klass_name(cfg: Any) -> str:
    return getattr(getattr(cfg, "klass", None), "__name__", type(cfg).__name__)


def hf_config_for(cfg: Any, source: dict | None = None) -> dict:
    """The Hugging Face `config.json` of a trainer config's model (LlamaForCausalLM), on top of
    the imported model's own (`source`) when there is one; unsupported parts are named."""
    decoder = cfg.model.decoder
    stack = decoder.transformer
    layer = stack.layer
    attention, ffn = layer.attention, layer.feed_forward
    from axplug.interop.hf_mappings import mapping_for_layer

    mapping = None if _klass_name(ffn) == "FeedForward" else mapping_for_layer(_klass_name(ffn))
    problems = []
    for path, sub, want in (
        ("model.decoder.output_norm", decoder.output_norm, "RMSNorm"),
        ("model.decoder.transformer.layer.norm", layer.norm, "RMSNorm"),
        ("model.decoder.transformer.layer.feed_forward", ffn,
         _klass_name(ffn) if mapping is not None else "FeedForward"),
        ("model.decoder.transformer.layer.attention.position", attention.position,
         "RotaryPositionTransform"),
    ):  # fmt: skip
        if _klass_name(sub) != want:
            problems.append(f"{path} is a {_klass_name(sub)} (a LLaMA needs {want})")
    if _klass_name(ffn) == "FeedForward" and not (ffn.gated and ffn.activation == "silu"):
        problems.append("model.decoder.transformer.layer.feed_forward is not a SwiGLU")
    position = attention.position
    if getattr(position, "interleaved", False) or getattr(position, "rotary_fraction", 1.0) != 1:
        problems.append("the RoPE is interleaved or partial (Hugging Face LLaMA: neither)")
    if attention.sliding_window is not None or attention.linear_bias_slopes is not None:
        problems.append("attention has a sliding window or an ALiBi bias")
    architecture = mapping.architecture if mapping is not None else "LlamaForCausalLM"
    extra = {}
    if mapping is not None:
        try:
            extra = mapping.hf_config(ffn)
        except ValueError as e:
            problems.append(f"model.decoder.transformer.layer.feed_forward: {e}")
    if problems:
        raise HFExportError(f"cannot export as {architecture}: " + "; ".join(problems))
    heads = attention.num_heads
    kv_heads = getattr(attention.qkv, "num_kv_heads", None) or heads
    head_dim = attention.head_dim or decoder.dim // heads
    raw = dict(source or {})
    raw.update(
        architectures=[architecture],
        model_type="llama" if mapping is None else architecture.split("For")[0].lower(),
        vocab_size=decoder.vocab_size,
        hidden_size=decoder.dim,
        intermediate_size=ffn.hidden_dim,
        num_hidden_layers=stack.num_layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        hidden_act="silu",
        rms_norm_eps=layer.norm.eps,
        rope_theta=position.theta,
        tie_word_embeddings=bool(decoder.tie_word_embeddings),
        attention_bias=False,
        mlp_bias=False,
        **extra,
    )
    if position.scaling_factor is not None:
        raw["rope_scaling"] = {
            "rope_type": "llama3",
            "factor": position.scaling_factor,
            "low_freq_factor": position.low_freq_factor,
            "high_freq_factor": position.high_freq_factor,
            "original_max_position_embeddings": position.original_max_position,
        }
    else:
        raw.setdefault("rope_scaling", None)
    raw.setdefault("max_position_embeddings", getattr(cfg.input, "seq_len", 2048))
    raw.setdefault("torch_dtype", "float32")
    return raw


def _layers(transformer: dict, num_layers: int) -> list[dict]:
    """Per-layer parameter trees of an unrolled (`layerN`) or scanned (`layer`) stack."""
    if "layer" in transformer:
        return [jax.tree.map(lambda a, i=i: a[i], transformer["layer"]) for i in range(num_layers)]
    return [transformer[f"layer{i}"] for i in range(num_layers)]


def hf_tensors(params: dict, raw: dict) -> dict[str, np.ndarray]:
    """Hugging Face tensor name -> numpy array, [out, in] for every projection; a plugin
    feed-forward's through its registered mapping."""
    from axplug.interop.hf_mappings import mapping_for_architecture

    arch = raw["architectures"][0]
    mapping = None if arch == "LlamaForCausalLM" else mapping_for_architecture(arch)
    decoder = params["decoder"]
    out = {
        "model.embed_tokens.weight": decoder["embedding"]["weight"],
        "model.norm.weight": decoder["output_norm"]["scale"],
    }
    if not raw["tie_word_embeddings"]:
        out["lm_head.weight"] = decoder["lm_head"]["weight"].T
    for i, layer in enumerate(_layers(decoder["transformer"], raw["num_hidden_layers"])):
        p = f"model.layers.{i}"
        attention = layer["attention"]
        out[f"{p}.input_layernorm.weight"] = layer["attention_norm"]["scale"]
        out[f"{p}.post_attention_layernorm.weight"] = layer["feed_forward_norm"]["scale"]
        for name in "qkv":
            out[f"{p}.self_attn.{name}_proj.weight"] = attention["qkv"][name]["weight"].T
        out[f"{p}.self_attn.o_proj.weight"] = attention["output"]["weight"].T
        ffn = layer["feed_forward"]
        if mapping is not None:
            out.update(mapping.export_tensors(ffn, p))
            continue
        out[f"{p}.mlp.gate_proj.weight"] = ffn["wi_gate"]["weight"].T
        out[f"{p}.mlp.up_proj.weight"] = ffn["wi_up"]["weight"].T
        out[f"{p}.mlp.down_proj.weight"] = ffn["wo"]["weight"].T
    return {k: np.ascontiguousarray(np.asarray(v)) for k, v in out.items()}


def export_hf(
    run_dir: str, output_dir: str, *, step: int | None = None, shard_bytes: int = 2**31
) -> dict:
    """Writes the run's model (latest step unless `step`) as a Hugging Face checkpoint into
    `output_dir`; returns its config.json content."""
    from safetensors.numpy import save_file

    from axplug.inference.loading import load_checkpoint
    from axplug.interop.hf_import import copy_tokenizer_files

    loaded = load_checkpoint(run_dir, step=step)
    lineage = loaded.lineage  # this run, then the runs it was tuned from
    source = next((m["source"]["config"] for _, m in lineage if m.get("source")), None)
    raw = hf_config_for(loaded.config, source)
    tokenizer_home = _tokenizer_home([d for d, _ in lineage], loaded.config)
    if tokenizer_home is not None and source is None:
        from axplug.tokenizer import load_tokenizer

        tok = load_tokenizer(tokenizer_home)
        raw.update(bos_token_id=tok.bos_id, eos_token_id=tok.eos_id)
    tensors = hf_tensors(jax.device_get(loaded.params), raw)
    os.makedirs(output_dir, exist_ok=True)
    shards: list[dict[str, np.ndarray]] = [{}]
    size = 0
    for name in sorted(tensors):
        if shards[-1] and size + tensors[name].nbytes > shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensors[name]
        size += tensors[name].nbytes
    if len(shards) == 1:
        save_file(shards[0], os.path.join(output_dir, "model.safetensors"), {"format": "pt"})
    else:
        weight_map = {}
        for i, shard in enumerate(shards, 1):
            file = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
            save_file(shard, os.path.join(output_dir, file), {"format": "pt"})
            weight_map.update(dict.fromkeys(shard, file))
        total = sum(t.nbytes for t in tensors.values())
        with open(os.path.join(output_dir, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=1)
    with open(os.path.join(output_dir, "config.json"), "w") as f:
        json.dump(raw, f, indent=1)
    if tokenizer_home is not None:
        copy_tokenizer_files(tokenizer_home, output_dir)
    return raw


def _tokenizer_home(run_dirs: list[str], cfg: Any) -> str | None:
    """The first of the runs' directories, then the run's data directory, with a tokenizer."""
    from axplug.tokenizer import has_tokenizer

    data = getattr(cfg.input, "path", None)
    candidates = [*run_dirs, data if isinstance(data, str) else None]
    return next((d for d in candidates if has_tokenizer(d)), None)
