"""How `axplug train` builds its Trainer config: a preset, a run (`--from`) or a file
(`--config`); then mesh rule, modifiers, `--input`, writers and overrides; then the checks
that need the whole config (vocabulary against the data)."""

from __future__ import annotations

import argparse
import sys
from typing import Any

__all__ = [
    "build_config",
    "base_config",
    "source_label",
    "with_input",
    "check_vocab",
    "run_config",
    "config_file",
    "read_config_file",
    "ConfigOverlay",
]


def build_config(args: argparse.Namespace):
    """The effective Trainer config for the parsed arguments."""
    from axplug.component_spec import component_config
    from axplug.config import ConfigError, apply_overrides
    from axplug.mesh_rules import select_mesh_rule
    from axplug.modifiers import make_modifier

    overrides = [] if args.output_dir is None else [f"output_dir={args.output_dir!r}"]
    for flag, field in (
        ("max_steps", "max_steps"),
        ("checkpoint_every", "checkpoint_every"),
        ("seed", "seed"),
    ):
        if getattr(args, flag) is not None:
            overrides.append(f"{field}={getattr(args, flag)}")
    if (args.step is not None or args.resume_optimizer) and args.from_run is None:
        raise ConfigError("--step and --resume-optimizer go with --from RUN_DIR")
    cfg, overlay = base_config(args)
    if overlay is not None:
        cfg = overlay.apply(cfg, trusted=args.trust_config)
    cfg = apply_overrides(cfg, overrides)  # the command line's flags win over the file
    if args.mesh_rule != "none":
        name, rule = select_mesh_rule(args.mesh_rule)
        cfg = rule.modifier()(cfg)
        print(f"mesh rule: {name}", file=sys.stderr)
    for spec in args.modifier:
        cfg = make_modifier(spec)(cfg)
    if args.input is not None:
        cfg = with_input(cfg, args.input)
    if args.writer:
        writers = [component_config("summary_writers", spec, "writer") for spec in args.writer]
        cfg.summary_writers = [*cfg.summary_writers, *writers]
    if args.seed is not None:
        cfg.input.seed = args.seed
    if cfg.eval_input is None and any(o.strip().startswith("eval_input.") for o in args.overrides):
        from axplug.input import eval_split_of

        cfg.eval_input = eval_split_of(cfg.input)  # `--set eval_input.x=...` edits this one
    cfg = apply_overrides(cfg, args.overrides)
    check_vocab(cfg, allow_mismatch=args.allow_vocab_mismatch, source=source_label(args))
    # What the run would refuse, refused here: `--print-config` prints only what can train.
    cfg.klass.check_config(cfg)
    return cfg


def base_config(args: argparse.Namespace):
    """(the config the run starts from, the `--config` overlay or None): a preset (`--preset`,
    or an overlay's `preset:`), a run's (`--from`), or a whole config file (`--config`)."""
    from axplug.config import ConfigError, UsageError, from_dict
    from axplug.presets import preset_config

    overlay = None
    if args.config is not None:
        data = read_config_file(args.config)
        if not is_overlay(data):  # a whole tree (a run's config.json, or to_dict form)
            if args.preset is not None or args.from_run is not None:
                raise UsageError(
                    f"--config {args.config}: a whole config (it names the root 'klass') "
                    "replaces the preset; give it alone, or make the file a partial tree of "
                    "the fields to change"
                )
            return from_dict(data, trusted=args.trust_config), None
        overlay = ConfigOverlay(args.config, data)
    if args.from_run is not None:
        if overlay is not None and overlay.preset is not None:
            raise UsageError(f"--config {args.config}: 'preset' and --from name two bases")
        cfg = run_config(args.from_run, args.step)
        restore = cfg.restore.clone(init_from=args.from_run, init_step=args.step,
                                    init_optimizer=args.resume_optimizer)  # fmt: skip
        return cfg.clone(restore=restore), overlay
    preset = args.preset or (overlay.preset if overlay is not None else None)
    if preset is None and args.config is None:
        raise UsageError("give the config to train: --preset NAME, --from RUN_DIR or --config FILE")
    if preset is None:
        raise ConfigError(
            f"--config {args.config}: a partial config needs a base: --preset NAME, --from "
            "RUN_DIR, or a 'preset: NAME' key in the file"
        )
    return preset_config(preset), overlay


def source_label(args: argparse.Namespace) -> str:
    """How the command line named the base config, for messages and provenance."""
    if args.from_run is not None:
        base = f"--from {args.from_run}"
    elif args.preset is not None:
        base = f"--preset {args.preset}"
    else:
        return f"--config {args.config}"
    return base if args.config is None else f"{base} --config {args.config}"


def run_config(run_dir: str, step: int | None):
    """The trainer config saved with a run's checkpoint (its latest, or `step`)."""
    from axplug.checkpoint import Checkpointer, checkpoint_directory
    from axplug.config import from_dict

    directory = checkpoint_directory(run_dir)
    with Checkpointer.default_config().set(directory=directory).instantiate() as checkpointer:
        metadata = checkpointer.metadata(step)
    if "config" not in metadata:
        from axplug.config import ConfigError

        raise ConfigError(f"--from {run_dir}: its checkpoint metadata holds no trainer config")
    return from_dict(metadata["config"])


def read_config_file(path: str) -> dict:
    """The mapping in a YAML, TOML or JSON config file (a run's config.json: its config): data
    only, so YAML aliases (which expand without bound) and a key given twice are refused."""
    import json
    import pathlib

    import tomllib

    from axplug.config import ConfigError, ConfigFileError

    file = pathlib.Path(path)
    if not file.is_file():
        raise ConfigFileError(f"--config: {path!r} does not exist")
    try:
        text = file.read_bytes().decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigFileError(
            f"--config {path}: not UTF-8 text (byte {e.object[e.start]:#04x} at offset "
            f"{e.start}); give a YAML, TOML or JSON file"
        ) from None

    def unique(pairs: list) -> dict:
        for i, (key, _) in enumerate(pairs):
            if any(key == k for k, _ in pairs[:i]):
                raise ConfigError(f"--config {path}: the key {key!r} is given twice")
        return dict(pairs)

    try:
        if file.suffix in (".yaml", ".yml"):
            data = _load_yaml(text, path)
        elif file.suffix == ".toml":
            data = tomllib.loads(text)
        else:
            data = json.loads(text, object_pairs_hook=unique)
    except ConfigError:
        raise
    except Exception as e:  # yaml.YAMLError, tomllib.TOMLDecodeError, json.JSONDecodeError
        kind = {".yaml": "YAML", ".yml": "YAML", ".toml": "TOML"}.get(file.suffix, "JSON")
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ConfigFileError(f"--config {path}: not {kind} ({first})") from None
    if not isinstance(data, dict):
        raise ConfigFileError(f"--config {path}: a {type(data).__name__}, not a mapping of fields")
    if "config" in data and "provenance" in data:
        data = data["config"]  # a run's config.json
    return data


def _load_yaml(text: str, path: str) -> Any:
    """YAML through a safe loader that refuses aliases and repeated keys (naming lines)."""
    from axplug.config import ConfigError

    try:
        import yaml
    except ImportError:
        raise ConfigError(f"--config {path}: YAML needs PyYAML: pip install pyyaml") from None

    class Loader(yaml.SafeLoader):
        def compose_node(self, parent: Any, index: Any) -> Any:
            if self.check_event(yaml.AliasEvent):
                line = self.peek_event().start_mark.line + 1
                raise ConfigError(
                    f"--config {path}: line {line}: a YAML alias (*name); write the value out"
                )
            return super().compose_node(parent, index)

        def construct_mapping(self, node: Any, deep: bool = False) -> dict:
            lines: dict = {}
            for key_node, _ in node.value:
                key, line = self.construct_object(key_node, deep=True), key_node.start_mark.line
                if key in lines:
                    raise ConfigError(
                        f"--config {path}: the key {key!r} is given twice (lines {lines[key]} "
                        f"and {line + 1})"
                    )
                lines[key] = line + 1
            return super().construct_mapping(node, deep)

    return yaml.load(text, Loader=Loader)  # noqa: S506 - a SafeLoader subclass


def config_file(path: str, *, trusted: bool):
    """A Trainer config from a whole-tree file (a run's config.json, or `to_dict` form)."""
    from axplug.config import from_dict

    return from_dict(read_config_file(path), trusted=trusted)


def is_overlay(data: dict) -> bool:
    """Whether a config file's mapping is a partial tree (no root `klass`)."""
    return "klass" not in data


class ConfigOverlay:
    """A `--config` file of the fields to change: `preset` (the base, unless --preset or
    --from name one), `modifiers` (specs, applied in order), `input` (an `--input` spec or a
    mapping of the input's fields), and any other fields, nested or dotted."""

    KEYS = ("preset", "modifiers", "input")

    def __init__(self, path: str, data: dict):
        from axplug.config import ConfigError

        self.path, self.data = path, dict(data)
        self.preset = self.data.pop("preset", None)
        self.modifiers = self.data.pop("modifiers", [])
        if isinstance(self.modifiers, str):
            self.modifiers = [self.modifiers]
        if self.preset is not None and not isinstance(self.preset, str):
            raise ConfigError(f"--config {path}: preset: {self.preset!r}, expected a name")
        if not isinstance(self.modifiers, list) or not all(
            isinstance(m, str) for m in self.modifiers
        ):
            raise ConfigError(
                f"--config {path}: modifiers: {self.modifiers!r}, expected a list of specs "
                "such as ['mesh:fsdp=-1']"
            )
        self.input = self.data.pop("input", None) if isinstance(data.get("input"), str) else None

    def apply(self, cfg, *, trusted: bool):
        """`cfg` with the file's modifiers, input and fields; errors name the file."""
        from axplug.config import ConfigError, apply_overlay
        from axplug.modifiers import make_modifier

        try:
            for spec in self.modifiers:
                cfg = make_modifier(spec)(cfg)
            if self.input is not None:
                cfg = with_input(cfg, self.input)
            return apply_overlay(cfg, self.data, trusted=trusted)
        except ConfigError as e:
            raise type(e)(f"--config {self.path}: {e}") from None


# What a run's shape is made of: kept from the preset's input unless the --input spec sets it.
_CARRIED_INPUT_FIELDS = ("seq_len", "batch_size", "seed")


def with_input(cfg, spec: str):
    """`cfg` training on the input `spec`: fields the spec leaves out (seq_len, batch_size,
    seed...) carry over from the preset's input; the model's vocab becomes the data's."""
    from axplug.component_spec import component_config, parse_spec
    from axplug.config import REQUIRED, ConfigError
    from axplug.input import data_vocab_size

    _, given = parse_spec(spec, "input")
    new = component_config("inputs", spec, "input")
    missing = [k for k, v in new.items() if v is REQUIRED]
    if missing:
        raise ConfigError(
            f"--input {spec!r}: give {', '.join(f'{k}=...' for k in missing)} "
            f"(e.g. --input {spec.split(':')[0]}:{missing[0]}=VALUE)"
        )
    for key in _CARRIED_INPUT_FIELDS:
        if key not in given and hasattr(new, key) and hasattr(cfg.input, key):
            setattr(new, key, getattr(cfg.input, key))
    cfg = cfg.clone(input=new, eval_input=None)
    vocab = data_vocab_size(new)
    decoder = getattr(cfg.model, "decoder", None)
    if vocab is not None and getattr(decoder, "vocab_size", None) not in (None, vocab):
        print(f"model vocab: {vocab} (the data's tokenizer; was {decoder.vocab_size})",
              file=sys.stderr)  # fmt: skip
        decoder.vocab_size = vocab
    return cfg


def check_vocab(cfg, *, allow_mismatch: bool, source: str) -> None:
    """Refuses a model whose vocab cannot hold the data's ids, and (unless allowed) a large
    model vocab trained on bytes."""
    from axplug.config import ConfigError
    from axplug.input import data_vocab_size

    decoder = getattr(cfg.model, "decoder", None)
    model = getattr(decoder, "vocab_size", None)
    data = data_vocab_size(cfg.input)
    if not isinstance(model, int) or data is None or model == data:
        return
    if model < data:
        raise ConfigError(
            f"model.decoder.vocab_size: {model} is smaller than the data's vocabulary {data}; "
            f"token ids up to {data - 1} would index past the embedding. Set it to >= {data}"
        )
    if data == 256 and not allow_mismatch:
        raise ConfigError(
            f"{source} has a {model}-token vocabulary but its input is bytes "
            "(vocab 256): tokenize your data with `axplug prepare-data FILES --tokenizer PATH "
            "--output DIR` and pass --input token_file:path=DIR, or give "
            "--allow-vocab-mismatch to train on bytes anyway"
        )
