"""Loading a trained (or imported) model for inference from its checkpoint directory."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from typing import Any

import jax

from axplug.checkpoint import Checkpointer, checkpoint_directory, restore_params
from axplug.checkpoint.errors import CheckpointError, CheckpointNotFoundError

__all__ = [
    "LoadedModel",
    "load_checkpoint",
    "find_tokenizer",
    "run_lineage",
    "source_stop_tokens",
]


@dataclasses.dataclass
class LoadedModel:
    """A model, its restored parameters, the trainer config it came from and the step; the
    mesh and axis rules the parameters are laid out by (for `Engine(mesh=, axis_rules=)`)."""

    model: Any
    params: Any
    config: Any
    step: int
    mesh: Any = None
    axis_rules: tuple = ()
    # (run directory, checkpoint metadata) of this run, then of each run it was tuned from.
    lineage: list = dataclasses.field(default_factory=list)
    _logits: Any = dataclasses.field(default=None, repr=False, compare=False)

    @property
    def vocab_size(self) -> int:
        return self.config.model.decoder.vocab_size

    def logits(self, ids: Any) -> Any:
        """float32 logits [batch, seq, vocab] of token `ids` [batch, seq]: one forward pass,
        compiled once per loaded model, laid out by its mesh."""
        import jax.numpy as jnp
        import numpy as np

        from axplug.context import functional
        from axplug.mesh import DEFAULT_AXIS_RULES
        from axplug.sharding import scoped

        if self._logits is None:

            def predict(params, ids):
                out, _ = functional(self.model, prng_key=None, state=params, inputs=(ids,),
                                    is_training=False, method="predict")  # fmt: skip
                return out.astype(jnp.float32)

            rules = self.axis_rules or DEFAULT_AXIS_RULES
            self._logits = jax.jit(scoped(predict, self.mesh, rules))
        return np.asarray(self._logits(self.params, jnp.asarray(ids, jnp.int32)))

    def with_model(self, model_cfg: Any, params: Any) -> LoadedModel:
        """This model transformed (adapters merged, weights quantized): `model_cfg` with its
        `params`, the run, step, mesh and lineage kept."""
        model = model_cfg.instantiate(parent=None, _path="model")
        config = self.config.clone(model=model_cfg)
        return dataclasses.replace(self, model=model, params=params, config=config, _logits=None)

    @property
    def stop_tokens(self) -> tuple[int, ...]:
        """End-of-sequence ids of the Hugging Face model it descends from (`eos_token_id` of
        its config and generation config), through the runs it was fine-tuned from."""
        return source_stop_tokens(self.lineage)


def load_checkpoint(
    path: str | os.PathLike,
    *,
    step: int | None = None,
    modifiers: Sequence[str] = (),
    devices: list | None = None,
    merge_adapters: bool = False,
) -> LoadedModel:
    """Restores the model of the run at `path` (a run directory or its checkpoints directory).

    The config comes from the checkpoint's metadata, so the same plugins must be installed as
    when it was written; `modifiers` (specs such as `paged_kv_cache:page_size=32`) may change
    how it runs but not its parameters. Parameters are laid out by the run's mesh rules over
    `devices` (default: the first device only, which suits decoding small models).
    `merge_adapters` folds the layers that fold (`axplug.layers.fold_layers`: LoRA adapters
    into their weights), so decoding runs no adapter matmuls.
    """
    from axplug.config import from_dict
    from axplug.mesh import parameter_shardings
    from axplug.modifiers import make_modifier

    directory = checkpoint_directory(os.fspath(path))
    with Checkpointer.default_config().set(directory=directory).instantiate() as checkpointer:
        try:
            step = checkpointer.latest_step() if step is None else step
            if step is None:
                raise CheckpointNotFoundError(f"no complete checkpoint in {directory}")
            metadata = checkpointer.metadata(step)
        except CheckpointNotFoundError as exc:
            raise CheckpointNotFoundError(
                f"{exc}; give a run directory written by `axplug train` or `axplug import-hf`"
            ) from None
        if "config" not in metadata:
            raise CheckpointNotFoundError(
                f"step {step} in {directory} has no trainer config in its metadata; it was not "
                "written by `axplug train` or `axplug import-hf`"
            )
        cfg = from_dict(metadata["config"])
        for spec in modifiers:
            cfg = make_modifier(spec)(cfg)
        devices = list(devices if devices is not None else jax.devices()[:1])
        if len(devices) == 1:  # a run trained on a mesh decodes on one device
            cfg = cfg.clone(mesh=cfg.mesh.clone(mesh_shape=(1,) * len(cfg.mesh.axis_names)))
        mesh_builder = cfg.mesh.instantiate()
        mesh = mesh_builder.build(devices)
        model = cfg.model.instantiate(parent=None, _path="model")
        specs = model.create_parameter_specs_recursively()
        shardings = parameter_shardings(specs, mesh, mesh_builder.axis_rules)
        abstract_params = jax.eval_shape(
            model.initialize_parameters_recursively, jax.random.PRNGKey(0)
        )
        target = jax.tree.map(
            lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
            abstract_params,
            shardings,
        )
        # Parameters only: the optimizer state (2x the parameters with Adam) is never read. A
        # fine-tune that froze its base stores what it trained, the rest read from its base.
        params = restore_params(checkpointer, step, target)
    loaded = LoadedModel(
        model=model,
        params=params,
        config=cfg,
        step=step,
        mesh=mesh,
        axis_rules=mesh_builder.axis_rules,
        lineage=run_lineage(path, step, metadata),
    )
    if merge_adapters:
        from axplug.layers import fold_layers

        loaded = loaded.with_model(*fold_layers(cfg.model, params))
    return loaded


def run_lineage(path: str, step: int, metadata: dict | None = None) -> list[tuple[str, dict]]:
    """(run directory, checkpoint metadata) of the run at `path` (its step `step`) and of
    each run it was initialized from (`init_from`), nearest first."""
    out: list[tuple[str, dict]] = []
    current: str | None = path
    while current is not None and len(out) < 16:
        if metadata is None:
            try:
                directory = checkpoint_directory(current)
                with Checkpointer.default_config().set(directory=directory).instantiate() as ck:
                    metadata = ck.metadata(step if not out else None)
            except (CheckpointError, OSError):
                if not out:
                    raise
                break  # a run it was tuned from is gone: the lineage ends there
        out.append((current, metadata))
        saved = metadata.get("config") or {}  # `init_from` of a run saved before 1.12
        current = (saved.get("restore") or {}).get("init_from", saved.get("init_from"))
        metadata = None
    return out


def source_stop_tokens(lineage: list[tuple[str, dict]]) -> tuple[int, ...]:
    """The end-of-sequence ids of the Hugging Face model a run descends from, if any."""
    for _, metadata in lineage:
        source = metadata.get("source") or {}
        if source.get("format") != "huggingface":
            continue
        ids: list[int] = []
        for config in (source.get("config") or {}, source.get("generation_config") or {}):
            value = config.get("eos_token_id")
            for token in value if isinstance(value, list) else [value]:
                if isinstance(token, int) and not isinstance(token, bool) and token not in ids:
                    ids.append(token)
        return tuple(ids)
    return ()


def find_tokenizer(loaded: LoadedModel, run_dir: str, explicit: str | None = None):
    """The tokenizer of a run's text: `explicit`, the run directory's (an import copies its
    model's), the one of the data it trained on, or bytes for a 256-token model."""
    from axplug.config import UsageError
    from axplug.input import input_class
    from axplug.input.remote import is_url, local_tokenizer
    from axplug.tokenizer import has_tokenizer, load_tokenizer

    if explicit is not None:
        return load_tokenizer(explicit)
    if has_tokenizer(run_dir):  # an import's copy of its model's tokenizer
        return load_tokenizer(run_dir)
    klass = input_class(loaded.config.input)
    data = klass.tokenizer_dir_of(loaded.config.input) if klass is not None else None
    if data is not None and is_url(str(data)):
        return load_tokenizer(local_tokenizer(str(data)))
    if data is not None and os.path.isfile(os.path.join(str(data), "meta.json")):
        return load_tokenizer(data)
    if loaded.vocab_size == 256:
        return load_tokenizer("bytes")
    raise UsageError(
        f"no tokenizer for this {loaded.vocab_size}-token model (none in the run directory "
        "or its data); pass one with --tokenizer PATH (or give token ids)"
    )
