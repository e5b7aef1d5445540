"""A run's LoRA adapters as a PEFT adapter directory (`adapter_model.safetensors` and
`adapter_config.json`), which PEFT, transformers and vLLM load over the base model."""

from __future__ import annotations

import json
import os
from typing import Any

import jax
import numpy as np

from axplug.api.config import ConfigError
from axplug_lora.layer import LoRAAdapter

__all__ = ["peft_adapter", "peft_tensors"]


def _adapters(params: dict) -> list[tuple[str, np.ndarray, np.ndarray]]:
    """(unrolled path of the adapted Linear, lora_a, lora_b) of every adapter in `params`;
    a scanned stack's adapters (a leading layer axis) one per layer."""
    from axplug.api.interop import flatten

    flat = {k: np.asarray(v) for k, v in flatten(params).items()}
    scanned = "decoder.transformer.layer."
    found = []
    for path in sorted(flat):
        if not path.endswith(".adapter.lora_a"):
            continue
        base = path.removesuffix(".adapter.lora_a")
        a, b = flat[path], flat[f"{base}.adapter.lora_b"]
        if base.startswith(scanned):
            rest = base[len(scanned) :]
            found += [(f"decoder.transformer.layer{i}.{rest}", a[i], b[i]) for i in range(len(a))]
        else:
            found.append((base, a, b))
    return found


def peft_tensors(model_cfg: Any, params: dict, rules: dict) -> tuple[dict, dict]:
    """(PEFT tensors, adapter_config.json) of the model's adapters; `rules` are the
    architecture's `HFTensor`s of the merged model, which name each adapted weight."""
    from axplug.api.config import find_configs

    adapters = _adapters(jax.device_get(params))
    if not adapters:
        raise ConfigError("export-lora: the run's model has no LoRA adapters (--modifier lora)")
    settings = {(c.rank, c.alpha, c.dropout) for _, c in find_configs(model_cfg, LoRAAdapter)}
    if len(settings) > 1:
        raise ConfigError(
            f"export-lora: the adapters have different rank/alpha/dropout {sorted(settings)}; "
            "a PEFT adapter here takes one setting: export the merged model with export-hf"
        )
    ((rank, alpha, dropout),) = settings
    tensors, modules = {}, set()
    for path, a, b in adapters:
        rule = rules.get(f"{path}.weight")
        if rule is None or not rule.transpose or rule.part is not None or rule.experts:
            raise ConfigError(
                f"export-lora: {path} is not a plain nn.Linear weight of the Hugging Face "
                "model (a fused or expert tensor); PEFT cannot load an adapter on it: export "
                "the merged model with export-hf"
            )
        module = rule.name.removesuffix(".weight")
        modules.add(module.rsplit(".", 1)[-1])
        # nn.Linear layout [out, in]: lora_A.weight [rank, in], lora_B.weight [out, rank].
        tensors[f"base_model.model.{module}.lora_A.weight"] = np.ascontiguousarray(a.T)
        tensors[f"base_model.model.{module}.lora_B.weight"] = np.ascontiguousarray(b.T)
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": rank,
        "lora_alpha": alpha,
        "lora_dropout": dropout,
        "target_modules": sorted(modules),
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "inference_mode": True,
        "modules_to_save": None,
        "base_model_name_or_path": None,
    }
    return tensors, config


def peft_adapter(
    run_dir: str, output_dir: str, *, step: int | None = None, force: bool = False
) -> dict:
    """Writes the run's adapters (latest step unless `step`) as a PEFT adapter directory;
    returns its adapter_config.json. Staged like `export-hf`: never a partial directory."""
    from safetensors.numpy import save_file

    from axplug.api.checkpoint import atomic_file, remove_stale_stages, staged_directory
    from axplug.api.interop import check_output, hf_config_for
    from axplug.api.layers import folded_config
    from axplug.api.run import load_checkpoint

    check_output(output_dir, force=force, run_dir=run_dir)
    loaded = load_checkpoint(run_dir, step=step)
    if not _adapters(jax.device_get(loaded.params)):  # before asking which family it is
        raise ConfigError(f"export-lora: {run_dir} has no LoRA adapters (train it with "
                          "--modifier lora)")  # fmt: skip
    source = next((m["source"]["config"] for _, m in loaded.lineage if m.get("source")), None)
    merged_model = folded_config(loaded.config.model)
    raw, arch = hf_config_for(loaded.config.clone(model=merged_model), source)
    tensors, config = peft_tensors(loaded.config.model, loaded.params, arch.tensors(merged_model))
    config["base_model_name_or_path"] = _base(loaded.lineage)
    os.makedirs(os.path.dirname(os.path.abspath(output_dir)), exist_ok=True)
    remove_stale_stages(output_dir)
    with staged_directory(output_dir, replace=force) as stage:
        save_file(tensors, os.path.join(stage, "adapter_model.safetensors"), {"format": "pt"})
        with atomic_file(os.path.join(stage, "adapter_config.json")) as f:
            f.write(json.dumps(config, indent=1).encode())
    return {**config, "architecture": raw["architectures"][0]}


def _base(lineage: list) -> str | None:
    """Where the base model came from: the imported checkpoint's source, else the first run
    the adapters were tuned from."""
    for _, metadata in lineage:
        source = metadata.get("source") or {}
        if source.get("path"):
            return str(source["path"])
    return lineage[1][0] if len(lineage) > 1 else None
