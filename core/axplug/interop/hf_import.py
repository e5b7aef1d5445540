"""`import_hf`: a Hugging Face checkpoint directory of an installed architecture -> an axplug run
directory.

The run directory looks like one the trainer wrote: `config.txt` and a complete checkpoint
`checkpoints/step_00000000` with metadata `{"step": 0, "config": to_dict(trainer config),
"opt_state": "fresh", "source": ...}`. Its state is `{"params", "step"}`: a fresh optimizer
state (`tx.init(params)`, twice the parameters with Adam) is not written but created where it
is needed (`axplug.trainer.fresh_optimizer`), so resuming the run or `axplug train --from` it
starts from the imported weights with exactly the state a trainer would have; the commands
that read weights only (generate, serve, eval, export-hf) read the parameters as from any run.

Every input is read and checked before the first write: each tensor (a floating-point dtype,
no NaN or inf, the shape config.json implies), the tokenizer files (loaded as `generate` loads
them) and generation_config.json. Then the tokenizer files and config.txt / config.json are
written, each under a temporary name renamed into place, and the checkpoint's commit comes
last: an import cut short leaves no complete step, and rerunning it into the same directory
removes what it left and starts over.

Peak host memory is about the parameters plus one shard: tensors are read one at a time with
one shard file open, each host array is dropped once on its devices, and the save writes data
files of `DATA_FILE_BYTES`, the most it holds beyond the parameters.
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import os
import pathlib
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from axplug.checkpoint import step_dir_name
from axplug.config import to_dict
from axplug.interop.from_config import hf_trainer_config, read_hf_config
from axplug.interop.hf_config import HFImportError, load_architecture
from axplug.interop.safetensors_dir import SafetensorsDir
from axplug.interop.tensors import IGNORED_SUFFIXES, hf_params
from axplug.tokenizer import TOKENIZER_FILES
from axplug.trainer import Trainer
from axplug.trainer.fresh_optimizer import FRESH_OPT_STATE
from axplug.trainer.run import write_config

__all__ = [
    "ImportResult",
    "import_hf",
    "IMPORT_STEP",
    "DATA_FILE_BYTES",
    "check_tokenizer_files",
    "copy_tokenizer_files",
]

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
    check_tokenizer_files(directory)
    generation_config = _generation_config(directory)
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
        arch = load_architecture(hf.architecture)
        rules = arch.tensors(cfg.model)
        tied = bool(cfg.model.decoder.tie_word_embeddings)
        unused = tuple(arch.ignored_tensors(cfg.model))
        with SafetensorsDir(directory, arch.checkpoint_prefixes) as tensors:
            params = hf_params(tensors, rules, trainer.param_specs)
            leftover = [
                name
                for name in tensors.unused()
                if not (_ignored(name, tied) or name.startswith(unused))
            ]
        if leftover:
            raise HFImportError(
                f"{directory}: {len(leftover)} tensor(s) of the checkpoint have no place in a "
                f"{hf.architecture}: {', '.join(leftover[:5])}{' ...' if len(leftover) > 5 else ''}"
            )
        num_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params))
        state = _state(trainer, params)
        del params
        metadata = {
            "step": IMPORT_STEP,
            "config": to_dict(cfg),
            **FRESH_OPT_STATE,
            "source": {
                "format": "huggingface",
                "directory": os.path.abspath(directory),
                "architecture": hf.architecture,
                "config": hf.raw,
                "generation_config": generation_config,
            },
        }
        # Everything but the checkpoint first, each file renamed into place once whole; the
        # checkpoint's commit is the import's last write, so an import cut anywhere (killed,
        # a full disk) leaves no complete step, and its rerun starts over.
        _remove_leftovers(checkpointer, output_dir)
        copy_tokenizer_files(directory, output_dir, remove_others=True)
        write_config(cfg)
        checkpointer.save(IMPORT_STEP, state, metadata)
        checkpointer.wait_until_finished()
    finally:
        checkpointer.close()
    return ImportResult(
        architecture=hf.architecture,
        config=cfg,
        checkpoint=f"{checkpointer.directory}/{step_dir_name(IMPORT_STEP)}",
        num_params=num_params,
        modifiers=tuple(modifiers),
    )


# A Hugging Face model's tokenizer, with its special-token config, and its image processor's
# settings: copied beside the import, where `axplug generate` finds them.
COPIED_TOKENIZER_FILES = (
    *TOKENIZER_FILES,
    "tokenizer_config.json",
    "preprocessor_config.json",
    "processor_config.json",
)


# What an import writes beside its checkpoint; a rerun removes their temporary files.
_RUN_FILES = (*COPIED_TOKENIZER_FILES, "config.txt", "config.json")


def check_tokenizer_files(directory: str) -> list[str]:
    """Loads each tokenizer file `directory` has, as `axplug generate` will; one that does not
    load fails naming it. Returns their names."""
    from axplug.config import ConfigDependencyError
    from axplug.tokenizer import TOKENIZER_FILES, load_tokenizer, read_tokenizer_config

    found = [n for n in COPIED_TOKENIZER_FILES if os.path.isfile(os.path.join(directory, n))]
    read_tokenizer_config(pathlib.Path(directory, "tokenizer_config.json"))
    for name in found:
        if name in TOKENIZER_FILES:
            try:
                load_tokenizer(os.path.join(directory, name))
            except ConfigDependencyError as exc:  # copied unchecked: the format's package is absent
                logging.getLogger(__name__).warning("%s; copying %s unchecked", exc, name)
    return found


def copy_tokenizer_files(
    directory: str, output_dir: str, *, remove_others: bool = False
) -> list[str]:
    """Copies the tokenizer files `directory` has into `output_dir`, each renamed into place
    once whole; with `remove_others`, deletes the ones `directory` lacks (an earlier attempt's).
    Returns the names copied."""
    from axplug.checkpoint import LocalStorage, storage_for
    from axplug.files import copy_file

    storage = storage_for(output_dir)
    copied = []
    for name in COPIED_TOKENIZER_FILES:
        source, target = os.path.join(directory, name), storage.join(output_dir, name)
        if not os.path.isfile(source):
            if remove_others:
                storage.delete(target)
            continue
        if isinstance(storage, LocalStorage):
            os.makedirs(os.fspath(storage.path(output_dir)), exist_ok=True)
            copy_file(source, os.fspath(storage.path(target)))
        else:  # an object store's write is whole or absent
            with open(source, "rb") as f:
                storage.path(target).write_bytes(f.read())
        copied.append(name)
    return copied


def _remove_leftovers(checkpointer: Any, output_dir: str) -> None:
    """What an import cut short left in `output_dir` (which holds no complete step): its
    temporary files and its partial save of the import step."""
    from axplug.files import is_temp_of

    storage = checkpointer.storage
    for entry in storage.listdir(output_dir):
        if is_temp_of(entry, _RUN_FILES):
            storage.delete(storage.join(output_dir, entry))
    prefix = step_dir_name(IMPORT_STEP)  # `step_00000000`, orbax's `step_00000000.orbax-...`
    for entry in storage.listdir(checkpointer.directory):
        if entry == prefix or entry.startswith(prefix + "."):
            storage.delete(storage.join(checkpointer.directory, entry))


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
    shardings = trainer.layout.shardings
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
