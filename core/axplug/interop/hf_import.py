"""`import_hf`: a Hugging Face checkpoint directory of an installed architecture -> an axplug run
directory.

The run directory looks like one the trainer wrote: `config.txt` and a complete checkpoint
`checkpoints/step_00000000` with metadata `{"step": 0, "config": to_dict(trainer config),
"opt_state": "fresh", "source": ...}`. Its state is `{"params", "step"}`: a fresh optimizer
state (`tx.init(params)`, twice the parameters with Adam) is not written but created where it
is needed (`axplug.trainer.fresh_optimizer`), so resuming the run or `axplug train --from` it
starts from the imported weights with exactly the state a trainer would have; the commands
that read weights only (generate, serve, eval, export-hf) read the parameters as from any run.

Peak host memory is about the parameters plus one shard: tensors are read one at a time with
one shard file open, each host array is dropped once on its devices, and the save writes data
files of `DATA_FILE_BYTES`, the most it holds beyond the parameters.
"""

from __future__ import annotations

import dataclasses
import gc
import os
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from axplug.config import to_dict
from axplug.interop.from_config import hf_trainer_config, read_hf_config
from axplug.interop.hf_config import HFImportError, load_architecture
from axplug.interop.safetensors_dir import SafetensorsDir
from axplug.interop.tensors import IGNORED_SUFFIXES, hf_params
from axplug.tokenizer import TOKENIZER_FILES
from axplug.trainer import Trainer
from axplug.trainer.fresh_optimizer import FRESH_OPT_STATE
from axplug.trainer.run import write_config

__all__ = ["ImportResult", "import_hf", "IMPORT_STEP", "DATA_FILE_BYTES", "copy_tokenizer_files"]

IMPORT_STEP = 0
# The import's checkpoint files: a save holds one file's compressed bytes in host memory (orbax's
# default is 2 GiB, which holds the whole checkpoint of most models).
DATA_FILE_BYTES = 64 * 2**20


@dataclasses.dataclass(frozen=True)
class ImportResult:
    """What `import_hf` wrote."""

    architecture: str
    config: Trainer.Config
    checkpoint: str  # the step directory
    num_params: int
    modifiers: tuple[str, ...]  # the modifier specs applied after the architecture's config


def import_hf(
    directory: str,
    output_dir: str,
    *,
    modifiers: Sequence[str] = (),
    overrides: Sequence[str] = (),
    devices: Sequence[jax.Device] | None = None,
) -> ImportResult:
    """Imports the checkpoint in `directory` into the run directory `output_dir`.

    `modifiers` and `overrides` apply after the import's own (e.g. `scan_layers` to scan the
    layer stack, `model.compute_dtype=float32`); ones that change parameter shapes fail.
    The state is laid out as the trainer lays it out on `devices` (default: all); a restore
    re-lays it out for whatever mesh loads it. Nothing is written until every tensor has been
    read and checked.
    """
    hf = read_hf_config(directory)
    cfg = hf_trainer_config(hf, output_dir=output_dir, modifiers=modifiers, overrides=overrides)
    # No summary writers: building them would create metric files in the output directory.
    # The data file size is the import's own: the saved config is `cfg`.
    checkpointer_cfg = cfg.checkpointer.clone(data_file_bytes=DATA_FILE_BYTES)
    trainer = cfg.clone(
        compilation_cache_dir=None, summary_writers=[], checkpointer=checkpointer_cfg
    ).instantiate(devices=devices)
    checkpointer = trainer.checkpointer
    try:
        existing = checkpointer.all_steps()
        if existing:
            raise HFImportError(
                f"{checkpointer.directory} already holds checkpoint step(s) "
                f"{', '.join(map(str, existing))}; import into an empty --output directory"
            )
        rules = load_architecture(hf.architecture).tensors(cfg.model)
        tied = bool(cfg.model.decoder.tie_word_embeddings)
        with SafetensorsDir(directory) as tensors:
            params = hf_params(tensors, rules, trainer.param_specs)
            leftover = [name for name in tensors.unused() if not _ignored(name, tied)]
        if leftover:
            raise HFImportError(
                f"{directory}: {len(leftover)} tensor(s) of the checkpoint have no place in a "
                f"{hf.architecture}: {', '.join(leftover[:5])}{' ...' if len(leftover) > 5 else ''}"
            )
        num_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params))
        state = _state(trainer, params)
        del params
        write_config(cfg)
        metadata = {
            "step": IMPORT_STEP,
            "config": to_dict(cfg),
            **FRESH_OPT_STATE,
            "source": {
                "format": "huggingface",
                "directory": os.path.abspath(directory),
                "architecture": hf.architecture,
                "config": hf.raw,
                "generation_config": _generation_config(directory),
            },
        }
        checkpointer.save(IMPORT_STEP, state, metadata)
        checkpointer.wait_until_finished()
        copy_tokenizer_files(directory, output_dir)
    finally:
        checkpointer.close()
    return ImportResult(
        architecture=hf.architecture,
        config=cfg,
        checkpoint=f"{checkpointer.directory}/step_{IMPORT_STEP:08d}",
        num_params=num_params,
        modifiers=tuple(modifiers),
    )


# A Hugging Face model's tokenizer, with its special-token config: copied beside the import,
# where `axplug generate` finds it.
COPIED_TOKENIZER_FILES = (*TOKENIZER_FILES, "tokenizer_config.json")


def copy_tokenizer_files(directory: str, output_dir: str) -> list[str]:
    """Copies the tokenizer files `directory` has into the run directory; returns their names."""
    from axplug.checkpoint import storage_for

    storage = storage_for(output_dir)
    copied = []
    for name in COPIED_TOKENIZER_FILES:
        source = os.path.join(directory, name)
        if os.path.isfile(source):
            with open(source, "rb") as f:
                storage.path(storage.join(output_dir, name)).write_bytes(f.read())
            copied.append(name)
    return copied


def _generation_config(directory: str) -> dict:
    """The model's generation_config.json (its stop tokens), or {} without one."""
    import json

    path = os.path.join(directory, "generation_config.json")
    if not os.path.isfile(path):
        return {}
    try:
        with open(path) as f:
            raw = json.load(f)
    except (OSError, ValueError) as exc:
        raise HFImportError(f"{path}: not a JSON object ({exc})") from None
    return raw if isinstance(raw, dict) else {}


def _ignored(name: str, tied: bool) -> bool:
    if name.endswith(IGNORED_SUFFIXES):
        return True
    # Some tied checkpoints also store the (identical) output projection.
    return tied and name == "lm_head.weight"


def _state(trainer: Trainer, params: dict) -> dict:
    """`{"params", "step"}` laid out on the trainer's mesh: the imported params and step 0."""
    shardings = trainer.state_shardings
    # Leaf by leaf, each host array dropped once on its devices: one copy of the parameters.
    # A transfer holds its host array until it completes, and then still from a reference
    # cycle: waited for and collected per leaf, or every host array outlives the loop.
    leaves, treedef = jax.tree.flatten(params)
    params.clear()
    targets = treedef.flatten_up_to(shardings["params"])
    for i, target in enumerate(targets):
        leaves[i] = jax.device_put(leaves[i], target).block_until_ready()
        gc.collect(1)
    params = jax.tree.unflatten(treedef, leaves)
    step = jax.device_put(jnp.asarray(IMPORT_STEP, jnp.int32), shardings["step"])
    return {"params": params, "step": step}
