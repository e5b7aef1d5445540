"""One error family: every user mistake is one `error:` line naming its config path, exit 2."""

import ast
import pathlib
import subprocess
import sys

import pytest

from axplug.cli import main
from axplug.config import ConfigError, ConfigValueError, UsageError

ROOT = pathlib.Path(__file__).resolve().parents[1]
TRAIN = ["train", "--preset", "gpt-tiny", "--mesh-rule", "none", "-q"]
TRAIN += ["--set", "compilation_cache_dir=None", "--set", "input.seq_len=16", "--max-steps", "1"]
KV_CACHE = "model.decoder.transformer.layer.attention.kv_cache"

# (extra arguments, the config path the one error line starts with): the 12 builtin
# ValueErrors of issue 29, each a ConfigError now.
CASES = [
    (["--set", "watchdog.timeout_s=0"], "watchdog.timeout_s"),
    (["--set", "watchdog.startup_timeout_s=-1"], "watchdog.startup_timeout_s"),
    (["--set", "watchdog.slow_step_factor=1"], "watchdog.slow_step_factor"),
    (["--set", "watchdog.exit_code=300"], "watchdog.exit_code"),
    (["--set", "watchdog.min_mfu=2"], "watchdog.min_mfu"),
    (["--set", "watchdog.min_device_busy_percent=0"], "watchdog.min_device_busy_percent"),
    (["--set", "watchdog.utilization_window=0"], "watchdog.utilization_window"),
    (["--set", "checkpointer.keep_last=0"], "checkpointer.keep_last"),
    (["--set", "checkpointer.keep_every=0"], "checkpointer.keep_every"),
    (["--modifier", "paged_kv_cache:page_size=0"], f"{KV_CACHE}.page_size"),
    (["--modifier", "paged_kv_cache:num_pages=0"], f"{KV_CACHE}.num_pages"),
    (["--writer", "progress:every_n_steps=0"], "summary_writers[2].every_n_steps"),
    (["--writer", "wandb:mode=loud"], "summary_writers[2].mode"),
]


def _one_error_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1, err
    assert "Traceback" not in err, err
    return lines[0]


@pytest.mark.parametrize(("extra", "path"), CASES, ids=[p for _, p in CASES])
def test_each_bad_setting_is_one_error_line_naming_its_path(tmp_path, capsys, extra, path):
    assert main([*TRAIN, "--output-dir", str(tmp_path), *extra]) == 2
    line = _one_error_line(capsys.readouterr().err)
    assert line.startswith(f"error: {path}: "), line


def test_a_real_command_prints_one_line_and_no_traceback(tmp_path):
    args = [*TRAIN, "--output-dir", str(tmp_path), "--set", "checkpointer.keep_last=0"]
    done = subprocess.run(
        [sys.executable, "-m", "axplug.cli", *args], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 2, done.stderr
    line = _one_error_line(done.stderr)
    assert line == "error: checkpointer.keep_last: must be at least 1, got 0"


def test_axplug_traceback_shows_the_traceback(tmp_path, monkeypatch):
    args = [*TRAIN, "--output-dir", str(tmp_path), "--set", "checkpointer.keep_last=0"]
    done = subprocess.run(
        [sys.executable, "-m", "axplug.cli", *args],
        capture_output=True,
        text=True,
        timeout=300,
        env={**__import__("os").environ, "AXPLUG_TRACEBACK": "1"},
    )
    assert done.returncode == 1  # Python's own exit for an uncaught exception
    assert "Traceback (most recent call last)" in done.stderr
    assert "ConfigValueError: checkpointer.keep_last: must be at least 1" in done.stderr


def test_field_error_starts_with_the_dotted_path():
    from axplug.checkpoint import Checkpointer
    from axplug.trainer import Trainer

    cfg = Trainer.default_config()
    error = cfg.checkpointer.field_error("keep_last", "must be at least 1; set it to 3")
    assert isinstance(error, ConfigValueError) and isinstance(error, ValueError)
    assert str(error) == "checkpointer.keep_last: must be at least 1; set it to 3"
    assert cfg.checkpointer.field_path("keep_last") == "checkpointer.keep_last"
    alone = Checkpointer.default_config()
    assert str(alone.field_error("keep_every", "x", UsageError)) == "keep_every: x"  # a root


@pytest.mark.parametrize(
    "argv",
    [
        ["info", "no_such_component_xyz"],
        ["train", "--preset", "no-such-preset", "--print-config"],
        ["launch", "--print", "slurm", "--preset", "no-such-preset", "--mesh-rule", "cpu"],
        ["new-plugin", "9bad"],
        ["checkpoints", "ls", "nosuchscheme://bucket/run"],
    ],
)
def test_user_mistakes_of_every_command_exit_2_in_one_line(argv, capsys, tmp_path):
    assert main(argv) == 2
    _one_error_line(capsys.readouterr().err)


# Raises of a builtin ValueError/TypeError that stay: a programmer's misuse of an API (not a
# config value), a request over HTTP, or a layer the format cannot express (wrapped by its
# caller in a ConfigError). File -> how many.
ALLOWED = {
    "core/axplug/tokenizer.py": 2,  # save() of a file-less tokenizer; a corrupt tiktoken file
    "core/axplug/runtime/goodput.py": 1,  # an unknown phase name from code
    "core/axplug/runtime/peers.py": 1,  # a peer timeout from code; the CLI's is UsageError
    "core/axplug/checkpoint/_local_files.py": 2,  # a local tier file that is not one
    "core/axplug/runtime/host_batch.py": 1,  # a device order no per-process input can feed
    "core/axplug/sharding.py": 1,
    "core/axplug/summary/base.py": 1,  # a summary value that is not a scalar
    "core/axplug/summary/jsonl.py": 1,  # reserved summary names, from code
    "core/axplug/inference/sampling.py": 1,  # the engine's API; the CLI wraps it (UsageError)
    "core/axplug/inference/engine.py": 5,
    "core/axplug/inference/admission.py": 10,  # Engine.checked: a request's problems, from code
    "core/axplug/api/_parameters.py": 2,  # ParameterSpec from code
    "core/axplug/input/base.py": 1,  # check_step: batch(step) from code
    "core/axplug/input/iterator.py": 5,  # resolve_function; IteratorInput wraps it
    "core/axplug/registry/_discovery.py": 1,  # discover(kind) from code
    "core/axplug/checkpoint/storage.py": 1,  # a storage plugin that builds no Storage
    "core/axplug/checkpoint/checkpointer.py": 4,  # save() arguments from code
    "plugins/attention/axplug_attention/alibi.py": 1,
    "plugins/lora/axplug_lora/table.py": 1,  # a caller's side input of the wrong row count
    "plugins/serve/axplug_serve/protocol.py": 18,  # HTTP requests (pydantic validators): a 400
    "plugins/serve/axplug_serve/images.py": 2,  # an image part's shape, inside the validators
    # A spec the guide cannot compile, a tokenizer it cannot read: the server's 400 names the
    # request field (axplug_serve.guided), by the Guide contract.
    "plugins/structured/axplug_structured/guide.py": 5,
    # hf_write's ValueError: what config.json cannot express (docs/model-families.md)
    "plugins/vision/axplug_vision/model.py": 1,
    "plugins/vision/axplug_vision/tower.py": 1,
    "plugins/structured/axplug_structured/tokens.py": 1,
    "plugins/serve/axplug_serve/worker.py": 1,
    "plugins/serve/axplug_serve/disaggregated.py": 1,
    # The chat template's refusals: serve and prepare-chat wrap them (UsageError, 400).
    "plugins/chat/axplug_chat/template.py": 2,
    # A chat record's refusals: prepare-data names the record (ConfigError).
    "plugins/chat/axplug_chat/encoder.py": 9,
    "plugins/dpo/axplug_dpo/data.py": 3,
    # `hf_write`: what config.json cannot express, by contract; export-hf names the config path.
    "core/axplug/layers/attention.py": 2,
    "core/axplug/layers/feed_forward.py": 1,
    "plugins/attention/axplug_attention/rope_hf.py": 2,  # write_rope, for hf_write
    "plugins/ffn_moe/axplug_moe/layer.py": 2,
    "plugins/ffn_moe/axplug_moe/router.py": 2,
    "plugins/attention/axplug_attention/mla.py": 2,
    "plugins/models/axplug_models/pattern.py": 10,
    "plugins/checkpoint_cloud/axplug_checkpoint_cloud/_orbax_routes.py": 1,
    # axplug-rl's functions called from code: the configs that reach them are checked first
    # (PolicyCausalLM, RolloutInput: ConfigError naming the field).
    "plugins/rl/axplug_rl/loss.py": 8,
    "plugins/rl/axplug_rl/advantages.py": 6,
    "plugins/rl/axplug_rl/sandbox.py": 2,
    "plugins/rl/axplug_rl/code_reward.py": 1,
    # A reward that fails on a sample scores it 0 and is counted, never raised to the run.
    "plugins/rl/axplug_rl/reward_set.py": 3,
    "plugins/rl/axplug_rl/rewards.py": 1,
    # A prompt record's refusals: the prompt set names the file and line (ConfigFileError).
    "plugins/rl/axplug_rl/prompts.py": 3,
}


def test_no_new_builtin_value_or_type_errors():
    """A new `raise ValueError/TypeError` is either a config value's (make it a ConfigError:
    `raise cfg.field_error(...)`, or UsageError for an option) or listed in ALLOWED."""
    found: dict[str, int] = {}
    for top in ("core/axplug", "plugins"):
        for path in sorted((ROOT / top).rglob("*.py")):
            # Not tests, nor the copies a wheel build leaves in plugins/*/build (test_wheels).
            if {"tests", "build"} & set(path.relative_to(ROOT / top).parts[:2]):
                continue
            for node in ast.walk(ast.parse(path.read_text())):
                exc = node.exc if isinstance(node, ast.Raise) else None
                call = exc.func if isinstance(exc, ast.Call) else exc
                if isinstance(call, ast.Name) and call.id in ("ValueError", "TypeError"):
                    rel = str(path.relative_to(ROOT))
                    found[rel] = found.get(rel, 0) + 1
    assert found == ALLOWED


def test_config_errors_are_one_family():
    from axplug.config import ConfigDependencyError, ConfigFileError, RequiredFieldError

    for cls in (UsageError, ConfigValueError, ConfigFileError, ConfigDependencyError):
        assert issubclass(cls, ConfigError)
    assert issubclass(RequiredFieldError, ConfigError)


def _error_classes():
    """(module, class name) of every class named `...Error` in the core and the plugins."""
    for top in ("core/axplug", "plugins"):
        for path in sorted((ROOT / top).rglob("*.py")):
            if {"tests", "build"} & set(path.relative_to(ROOT / top).parts[:2]):
                continue
            parts = path.relative_to(ROOT / top).with_suffix("").parts
            parts = ("axplug", *parts) if top == "core/axplug" else parts[1:]
            module = ".".join(p for p in parts if p != "__init__")
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.ClassDef) and node.name.endswith("Error"):
                    yield module, node.name


def test_every_error_axplug_raises_is_one_family_with_its_exit_code():
    """One root (`axplug.api.AxplugError`, the plugins' too): the CLI's boundary reads each
    error's exit code from it instead of listing classes."""
    import importlib

    from axplug.api import AxplugError
    from axplug.checkpoint import CheckpointNotFoundError, StorageNotFoundError
    from axplug.cli.main import _exit_code
    from axplug.registry import ComponentNotFoundError, PluginLoadError

    classes = list(_error_classes())
    assert len(classes) > 25
    for module, name in classes:
        try:
            cls = getattr(importlib.import_module(module), name)
        except ImportError as exc:  # an optional plugin's module (its dependency absent)
            pytest.skip(f"{module}: {exc}")
        assert issubclass(cls, AxplugError), f"{module}.{name}"
    assert _exit_code(UsageError("--x: bad")) == 2
    assert _exit_code(ComponentNotFoundError("no layer 'x'")) == 2
    assert _exit_code(StorageNotFoundError("no storage for gs://")) == 2
    assert _exit_code(CheckpointNotFoundError("no checkpoint in d")) == 1
    assert _exit_code(PluginLoadError("import failed", None)) == 1
    assert _exit_code(OSError("disk full")) == 1
    assert _exit_code(KeyError("a bug")) is None
