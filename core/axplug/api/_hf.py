"""The Hugging Face architecture contract: how a model family reads and writes checkpoints.

A family is an `axplug.architectures` entry (named by its Hugging Face architecture, e.g.
`Qwen3ForCausalLM`) loading an `HFArchitecture`: it picks the layer classes (`base_config`) and
names the tensors (`tensors`). The fields of config.json belong to the layers: each layer class
that has Hugging Face fields implements `hf_read(cfg, fields)` (set its config from
config.json) and `hf_write(cfg) -> dict` (the fields its config implies; `ValueError` naming
what config.json cannot express). The core walks the model config calling them, so it never
spells a field, and a field that no layer read is refused by name. A layer whose class sets
`hf_writes_subtree = True` writes the fields of every layer config under it in its own
`hf_write` (theirs are not called): a stack whose layers differ by kind (Gemma 2's
`layer_types`) knows what each kind's layers write.

Standard library only: config.json is read and checked before jax is imported.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

__all__ = ["HFArchitecture", "HFFields", "HFTensor", "METADATA_FIELDS", "MISSING"]


class _Missing:
    def __repr__(self) -> str:
        return "MISSING"


MISSING: Any = _Missing()

# config.json fields of every Hugging Face model that say nothing about the numerics axplug
# computes (token ids, generation and serialization settings); the core reads dtype itself.
METADATA_FIELDS = frozenset(
    {
        "architectures", "model_type", "transformers_version", "_name_or_path", "dtype",
        "torch_dtype", "bos_token_id", "eos_token_id", "pad_token_id", "use_cache",
        "initializer_range", "output_attentions", "output_hidden_states", "return_dict",
        "max_position_embeddings", "tokenizer_class", "_attn_implementation_autoset",
        "output_router_logits", "auto_map", "sep_token_id", "decoder_start_token_id",
        "is_decoder", "add_cross_attention", "tie_encoder_decoder", "chunk_size_feed_forward",
        "id2label", "label2id", "problem_type", "task_specific_params", "prefix",
        "finetuning_task", "use_bfloat16", "pruned_heads", "torchscript", "tf_legacy_loss",
        "cross_attention_hidden_size", "is_encoder_decoder", "_commit_hash",
    }
)  # fmt: skip


class HFFields:
    """A config.json being read by the layers: each read is recorded, with its problems.

    `defaults` are the Hugging Face config class's values for fields a config.json may leave
    out; `aliases` map the names layers ask for to this family's names (GPT-2: `hidden_size`
    is `n_embd`), as Hugging Face's `attribute_map` does; `implied` are fields the family fixes
    in its code, never in config.json (Qwen2: `qkv_bias` is True), read like any other.
    """

    def __init__(
        self,
        raw: Mapping[str, Any],
        *,
        source: str = "config.json",
        defaults: Mapping[str, Any] | None = None,
        aliases: Mapping[str, str] | None = None,
        implied: Mapping[str, Any] | None = None,
    ):
        self.raw = dict(raw)
        self.source = source
        self._defaults = dict(defaults or {})
        self._aliases = dict(aliases or {})
        self.implied = dict(implied or {})
        self.read: set[str] = set()
        self.problems: list[str] = []
        self._scopes: dict[str, HFFields] = {}
        self._prefix = ""  # a nested object's problems are named by its key

    def within(self, key: str, **settings: Any) -> HFFields:
        """The fields of the nested object `key` (a vision-language model's text model's),
        read with their own `defaults`, `aliases` and `implied` (`settings`, taken on the
        first call; later calls return the same view). Their reads, problems and unread
        fields are this config.json's, named `key.field`."""
        if key not in self._scopes:
            raw = self.get(key, {})
            if not isinstance(raw, Mapping):
                self.problem(f"{key}={raw!r} (expected an object)")
                raw = {}
            scope = HFFields(raw, source=self.source, **settings)
            scope.problems = self.problems
            scope._prefix = f"{self._prefix}{key}: "
            self._scopes[key] = scope
        return self._scopes[key]

    def name(self, field: str) -> str:
        """The family's name of `field`."""
        return self._aliases.get(field, field)

    def get(self, field: str, default: Any = MISSING) -> Any:
        """The field's value (null counts as absent); absent and no default: a problem."""
        name = self.name(field)
        self.read.add(name)
        value = self.implied[name] if name in self.implied else self.raw.get(name)
        if value is None:
            value = self._defaults.get(name)
        if value is None:
            if default is MISSING:
                self.problem(f"missing required field {name}")
            return None if default is MISSING else default
        return value

    def positive_int(self, field: str, default: Any = MISSING) -> int:
        """An integer >= 1 (0 after recording the problem)."""
        value = self.get(field, default)
        if value is None:
            return 0
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            self.problem(f"{self.name(field)}={value!r} (expected a positive integer)")
            return 0
        return value

    def number(self, field: str, default: Any = MISSING, *, positive: bool = True) -> float:
        """A float (1.0 after recording the problem)."""
        value = self.get(field, default)
        if value is None:
            return 1.0
        if (
            isinstance(value, bool)
            or not isinstance(value, (int, float))
            or (positive and value <= 0)
        ):
            kind = "a positive number" if positive else "a number"
            self.problem(f"{self.name(field)}={value!r} (expected {kind})")
            return 1.0
        return float(value)

    def expect(self, field: str, *allowed: Any, why: str = "") -> Any:
        """The field's value, which must be one of `allowed` (absent reads as `allowed[0]`)."""
        value = self.get(field, allowed[0])
        if value not in allowed:
            options = " or ".join(repr(a) for a in allowed)
            self.problem(
                f"{self.name(field)}={value!r} (only {options}{'; ' + why if why else ''})"
            )
        return value

    def problem(self, message: str) -> None:
        """Records what makes this config.json unimportable; all are reported at once."""
        message = self._prefix + message
        if message not in self.problems:
            self.problems.append(message)

    def unread(self) -> dict[str, Any]:
        """Fields that neither a layer read nor `METADATA_FIELDS` covers, by name (a nested
        object's as `key.field`), with their values."""
        out = {n: self.raw[n] for n in sorted(set(self.raw) - self.read - METADATA_FIELDS)}
        for key, scope in self._scopes.items():
            out.update({f"{key}.{n}": v for n, v in scope.unread().items()})
        return out


@dataclasses.dataclass(frozen=True)
class HFTensor:
    """Where one axplug parameter lives in a Hugging Face checkpoint.

    The stored tensor `name` is taken in the checkpoint's layout; `part=(axis, start, stop)`
    cuts one parameter out of a fused tensor (Phi-3's qkv_proj, GPT-2's c_attn), then
    `transpose` turns an [out, in] `nn.Linear` weight into axplug's [in, out]. With `experts`,
    `name` holds `{e}` and the parameter stacks experts 0..experts-1 on a leading axis.
    """

    name: str
    transpose: bool = False
    part: tuple[int, int, int] | None = None
    experts: int | None = None

    def names(self) -> list[str]:
        """The checkpoint tensor names this parameter is read from."""
        if self.experts is None:
            return [self.name]
        return [self.name.format(e=e) for e in range(self.experts)]


class HFArchitecture:
    """Base of `axplug.architectures` entries (a class built with no arguments, or an instance):
    every optional member with its default. An entry that does not derive from it is given it
    as a last base when loaded (`axplug.registry.conformed`)."""

    architecture: str  # the Hugging Face class, e.g. "Qwen3ForCausalLM"; the entry's name
    model_type: str  # config.json's model_type, e.g. "qwen3"
    defaults: Mapping[str, Any] = {}  # the HF config class's values for fields one may omit
    aliases: Mapping[str, str] = {}  # layer field name -> this family's (GPT-2: n_embd)
    implied: Mapping[str, Any] = {}  # fields the family's code fixes, never in config.json

    def base_config(self, fields: HFFields) -> Any:
        """The trainer config with this family's layer classes; the layers' `hf_read` then
        fill in their fields. Structure that depends on config.json (which layers are MoE,
        the attention pattern) may read `fields` here."""
        raise NotImplementedError(type(self).__qualname__)

    def tensors(self, model: Any) -> dict[str, HFTensor]:
        """Every parameter of `model` (the filled-in model config), by its path in the
        unrolled parameter tree (`decoder.transformer.layer0.attention.qkv.q.weight`)."""
        raise NotImplementedError(type(self).__qualname__)

    # Checkpoint tensor-name prefixes read as another (an older layout's `vision_tower.
    # vision_model.` as `vision_tower.`): tensors are named as in `tensors` either way.
    checkpoint_prefixes: Mapping[str, str] = {}

    def ignored_tensors(self, model: Any) -> tuple[str, ...]:
        """Prefixes of checkpoint tensors `model` leaves unused (a vision tower's layers past
        the one whose features a vision-language model takes). None by default."""
        return ()

    def config_fields(self, model: Any) -> dict[str, Any]:
        """The config.json fields the family itself reads in `base_config` (options only its
        Hugging Face code has, e.g. Gemma 2's soft-caps), written by an export; the rebuild
        check then proves they round-trip. None by default."""
        return {}
