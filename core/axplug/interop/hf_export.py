"""`export_hf`: a run's model -> a Hugging Face checkpoint directory (`config.json`, sharded
safetensors with their index, the tokenizer files), through the installed architecture that
builds the same model. The inverse of `import_hf`.

config.json is the imported model's own (token ids and the like) with every field the run's
layers write (`hf_write`) over it. Before anything is written the architecture rebuilds the
model from that config.json; where the rebuilt model would compute something else (a layer
it lacks, an option it does not set, a source field the run no longer agrees with), the
export is refused naming the config path, so a checkpoint never loads as another model.

The export is written into a temporary directory beside the output and renamed into place
once complete (`axplug.files.staged_directory`): the output directory is missing, the old
one or the new one whole, never a mix.
"""

from __future__ import annotations

import json
import math
import os
import re
from typing import Any

import jax
import numpy as np

from axplug.interop.hf_config import HFImportError, load_architecture, registered_architectures

__all__ = ["export_hf", "check_output", "hf_config_for", "HFExportError"]


class HFExportError(HFImportError):
    """The run's model has something no installed Hugging Face architecture expresses."""


def _try(arch: Any, cfg: Any, source: dict | None) -> tuple[dict | None, list[str]]:
    """(config.json, []) when `arch` expresses the model of `cfg`, else (None, why not)."""
    from axplug.interop.from_config import hf_fields, model_from_fields
    from axplug.interop.hf_walk import differences, read_fields, write_fields

    written, problems = write_fields(cfg.model)
    if problems:
        return None, problems
    written = _merged(written, arch.config_fields(cfg.model))  # read in base_config
    mine = dict(written)  # the layers' own names, before the family's aliases and implied
    aliases, implied = arch.aliases, arch.implied
    written = {aliases.get(k, k): v for k, v in written.items()}
    written = {k: v for k, v in written.items() if k not in implied}  # checked by the rebuild
    # The source's fields under the run's: one the run no longer agrees with fails the
    # rebuild below, so none survives silently.
    base = dict(source or {})
    raw = {**_merged(base, written), "architectures": [arch.architecture]}
    raw["model_type"] = arch.model_type
    from axplug.input import batch_shape

    raw.setdefault(aliases.get("max_position_embeddings", "max_position_embeddings"),
                   (batch_shape(cfg.input) or (0, 2048))[1])  # fmt: skip
    try:
        rebuilt = model_from_fields(arch, hf_fields(raw, arch))
    except HFImportError as exc:
        return None, [str(exc)]
    # What the rebuilt layers write must be what the run's wrote: a field the family fixes
    # (`implied`) or defaults where config.json leaves it out would otherwise pass unseen,
    # since the run's own layers below re-read the same config.json.
    again, _ = write_fields(rebuilt.model)
    again = _merged(again, arch.config_fields(rebuilt.model))
    lost = [
        f"{aliases.get(k, k)}={v!r} (a {arch.architecture} built from the config.json has "
        f"{again[k]!r})"
        if k in again
        else f"{aliases.get(k, k)}={v!r} (a {arch.architecture} has no such field)"
        for k, v in mine.items()
        if k not in again or not _same_value(v, again[k])
    ]
    own = cfg.model.clone()
    read_fields(own, hf_fields(raw, arch))  # the run's own layers, normalized the same way
    diff = lost + differences(own, rebuilt.model)
    return (raw, []) if not diff else (None, diff)


def _merged(base: dict, over: dict) -> dict:
    """`over` on `base`, where a nested model config (a key ending `_config`: a
    vision-language model's text model) is merged field by field: its fields the run does
    not write (its model type) are kept."""
    out = dict(base)
    for key, value in over.items():
        nested = key.endswith("_config") and isinstance(value, dict)
        out[key] = _merged(out.get(key) or {}, value) if nested else value
    return out


def _same_value(a: Any, b: Any) -> bool:
    """Equal config.json values; floats to rounding (a coefficient scaled and scaled back)."""
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same_value(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same_value(x, y) for x, y in zip(a, b, strict=True))
    numbers = (int, float)
    if isinstance(a, numbers) and isinstance(b, numbers) and not isinstance(a, bool):
        return not isinstance(b, bool) and math.isclose(a, b, rel_tol=1e-9, abs_tol=0.0)
    return a == b


def hf_config_for(cfg: Any, source: dict | None = None) -> tuple[dict, Any]:
    """(config.json, architecture) of a trainer config's model: the source's architecture
    when it was imported, else the first installed one that expresses it."""
    names = registered_architectures()
    wanted = (source or {}).get("architectures") or []
    order = [n for n in wanted if n in names] + [n for n in names if n not in wanted]
    reasons = []
    for name in order:
        arch = load_architecture(name)
        raw, why = _try(arch, cfg, source)
        if raw is not None:
            raw.setdefault("torch_dtype", "float32")
            return raw, arch
        reasons.append(f"as {name}: " + "; ".join(why[:4]))
        if name in wanted:
            break  # a model imported as one architecture exports as that one or not at all
    raise HFExportError(
        "cannot export this model: " + " | ".join(reasons or ["no architecture is installed"])
    )


def _write_shards(tensors, output_dir: str, shard_bytes: int) -> None:
    """Streams (name, array) into safetensors shards of at most `shard_bytes` (one tensor
    over it gets a shard of its own), then the index when there is more than one."""
    from safetensors import SafetensorError
    from safetensors.numpy import save_file

    from axplug.files import atomic_file

    files: list[tuple[str, list[str]]] = []
    total = 0
    shard: dict[str, np.ndarray] = {}
    size = 0

    def flush() -> None:
        nonlocal shard, size
        if shard:
            tmp = os.path.join(output_dir, f".shard-{len(files) + 1:05d}.safetensors")
            try:
                save_file(shard, tmp, {"format": "pt"})
            except SafetensorError as exc:
                error = _os_error(exc, tmp)
                if error is exc:
                    raise
                raise error from exc
            files.append((tmp, list(shard)))
        shard, size = {}, 0

    for name, array in tensors:
        if shard and size + array.nbytes > shard_bytes:
            flush()
        shard[name] = array
        size += array.nbytes
        total += array.nbytes
    flush()
    if len(files) == 1:
        os.replace(files[0][0], os.path.join(output_dir, "model.safetensors"))
        return
    weight_map = {}
    for i, (tmp, names) in enumerate(files, 1):
        file = f"model-{i:05d}-of-{len(files):05d}.safetensors"
        os.replace(tmp, os.path.join(output_dir, file))
        weight_map.update(dict.fromkeys(names, file))
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    with atomic_file(os.path.join(output_dir, "model.safetensors.index.json")) as f:
        f.write(json.dumps(index, indent=1).encode())


def _os_error(exc: Exception, path: str) -> Exception:
    """safetensors' error for an OS error (`... (os error 28)`) as that `OSError` naming
    `path`, so a full disk reads as one; any other error as it is."""
    found = re.search(r"\(os error (\d+)\)", str(exc))
    if found is None:
        return exc
    code = int(found.group(1))
    return OSError(code, os.strerror(code), path)


def check_output(output_dir: str, *, force: bool = False, run_dir: str | None = None) -> None:
    """Refuses an `output_dir` that is a file, or a non-empty directory unless `force`, or
    that is (or holds) `run_dir`, which replacing it would delete."""
    from axplug.config import UsageError

    if run_dir is not None and "://" not in run_dir:  # a run on an object store is not local
        target, run = os.path.realpath(output_dir), os.path.realpath(run_dir)
        if run == target or run.startswith(target.rstrip(os.sep) + os.sep):
            raise UsageError(
                f"--output {output_dir}: holds the run {run_dir} being exported; give a "
                "directory of its own"
            )
    if os.path.lexists(output_dir) and not os.path.isdir(output_dir):
        raise UsageError(
            f"--output {output_dir}: is a file, not a directory; give a new directory's path"
        )
    held = sorted(os.listdir(output_dir)) if os.path.isdir(output_dir) else []
    if held and not force:
        shown = ", ".join(held[:4]) + (f" and {len(held) - 4} more" if len(held) > 4 else "")
        raise UsageError(
            f"--output {output_dir}: not empty (holds {shown}); give a new or empty directory, "
            "or --force to replace it whole"
        )


def export_hf(
    run_dir: str,
    output_dir: str,
    *,
    step: int | None = None,
    shard_bytes: int = 2**31,
    force: bool = False,
) -> dict:
    """Writes the run's model (latest step unless `step`) as a Hugging Face checkpoint into
    `output_dir`; returns its config.json content.

    `output_dir` must be new or empty unless `force`, which replaces it whole. The checkpoint
    is written into a temporary directory beside it (`.NAME.tmp-PID`) renamed to `output_dir`
    once complete, so `output_dir` never holds a partial export, nor an old one's files; the
    temporary directories of exports killed before are deleted.
    """
    from axplug.files import atomic_file, remove_stale_stages, staged_directory
    from axplug.inference.loading import load_checkpoint
    from axplug.interop.hf_import import check_tokenizer_files, copy_tokenizer_files
    from axplug.layers import fold_layers

    check_output(output_dir, force=force, run_dir=run_dir)
    loaded = load_checkpoint(run_dir, step=step)
    lineage = loaded.lineage  # this run, then the runs it was tuned from
    source = next((m["source"]["config"] for _, m in lineage if m.get("source")), None)
    # Layers that fold (a LoRA adapter) are written as what they fold into (merged weights).
    model_cfg, params = fold_layers(loaded.config.model, loaded.params)
    config = loaded.config.clone(model=model_cfg)
    raw, arch = hf_config_for(config, source)
    tokenizer_home = _tokenizer_home([d for d, _ in lineage], config)
    if tokenizer_home is not None:
        check_tokenizer_files(tokenizer_home)
    if tokenizer_home is not None and source is None:
        from axplug.tokenizer import load_tokenizer

        tok = load_tokenizer(tokenizer_home)
        raw.update(bos_token_id=tok.bos_id, eos_token_id=tok.eos_id)
    from axplug.interop.tensors import hf_tensors

    rules = arch.tensors(model_cfg)
    tensors = hf_tensors(jax.device_get(params), rules)
    os.makedirs(os.path.dirname(os.path.abspath(output_dir)), exist_ok=True)
    remove_stale_stages(output_dir)
    with staged_directory(output_dir, replace=force) as stage:
        _write_shards(tensors, stage, shard_bytes)
        if tokenizer_home is not None:
            copy_tokenizer_files(tokenizer_home, stage)
        with atomic_file(os.path.join(stage, "config.json")) as f:
            f.write(json.dumps(raw, indent=1).encode())
    return raw


def _tokenizer_home(run_dirs: list[str], cfg: Any) -> str | None:
    """The first of the runs' directories, then the run's data directory, with a tokenizer."""
    from axplug.input import input_class
    from axplug.tokenizer import has_tokenizer

    klass = input_class(cfg.input)
    candidates = [*run_dirs, klass.tokenizer_dir_of(cfg.input) if klass is not None else None]
    return next((d for d in candidates if has_tokenizer(d)), None)
