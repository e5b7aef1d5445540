"""Presets, mesh rules and the `axplug train` command."""

import jax
import pytest
from axplug_testing import tiny_train_args

from axplug import registry
from axplug.cli import main
from axplug.config import ConfigError, find_configs
from axplug.layers import RepeatedTransformer, StackedTransformer
from axplug.mesh_rules import detect_selector, select_mesh_rule
from axplug.presets import preset_config, resolve_preset
from axplug.summary import read_jsonl

# Published parameter counts (embeddings and LM head untied).
KNOWN_PARAMS = {
    "llama2-7b": 6_738_415_616,
    "llama2-70b": 68_976_648_192,
    "llama3-8b": 8_030_261_248,
    "mixtral-8x7b": 46_702_792_704,
}


def _missing_modifier(preset):
    from axplug.modifiers import parse_modifier_spec

    for spec in preset.modifiers:
        name, _ = parse_modifier_spec(spec)
        if name not in registry.names("modifiers"):
            return name
    return None


@pytest.mark.parametrize("name", ["gpt-tiny", "llama-tiny", "llama2-7b"])
def test_every_preset_builds_and_traces_or_names_its_package(name):
    try:
        preset = resolve_preset(name)
    except registry.ComponentNotFoundError:
        pytest.skip(f"{name} is a plugin's preset and the plugin is not installed")
    missing = _missing_modifier(preset)
    if missing is not None:
        with pytest.raises(ConfigError) as err:
            preset_config(preset.name)
        installed = {c.name for c in registry.discover("modifiers")}
        expected = (
            f"preset {preset.name} needs modifier {missing!r} from {preset.providers[missing]}, "
            "which is disabled"
            if missing in installed
            else f"preset {preset.name} needs modifier {missing!r}: pip install "
            f"{preset.providers[missing]}"
        )
        assert str(err.value).startswith(expected)
        return
    cfg = preset_config(preset.name)
    model = cfg.model.instantiate()
    shapes = jax.eval_shape(model.initialize_parameters_recursively, jax.random.PRNGKey(0))
    count = sum(x.size for x in jax.tree.leaves(shapes))
    if preset.name in KNOWN_PARAMS:
        assert count == KNOWN_PARAMS[preset.name]
    specs = model.create_parameter_specs_recursively()
    assert jax.tree.map(lambda s: s.shape, specs, is_leaf=lambda s: hasattr(s, "mesh_axes")) == (
        jax.tree.map(lambda x: x.shape, shapes)
    )


def test_missing_modifier_names_the_package_before_any_work(plugin_site):
    plugin_site.add(
        "fake-presets",
        {"axplug.presets": {"warp-tiny": "fake_presets_mod:WARP"}},
        modules={"fake_presets_mod": (
            "from axplug.presets import Preset, gpt_tiny\n"
            "BUILT = []\n"
            "def build():\n"
            "    BUILT.append(1)\n"
            "    return gpt_tiny.build()\n"
            "WARP = Preset('warp-tiny', 'test', build, ('warp:speed=9',),\n"
            "              {'warp': 'axplug-warp'})\n"
        )},
    )  # fmt: skip
    with pytest.raises(
        ConfigError, match="^preset warp-tiny needs modifier 'warp': pip install axplug-warp$"
    ):
        preset_config("warp-tiny")
    import fake_presets_mod

    assert fake_presets_mod.BUILT == []  # failed before building anything


MOVED = [("quantize:int8", "axplug-quantize"), ("pipeline", "axplug-pipeline")]


def _moved_preset(monkeypatch, modifier, package):
    """A registered preset `moved-tiny`: llama-tiny plus `modifier` from `package`."""
    from axplug.presets import Preset

    llama_tiny = resolve_preset("llama-tiny")
    name = modifier.split(":")[0]
    preset = Preset("moved-tiny", "test", llama_tiny.build, (*llama_tiny.modifiers, modifier),
                    {**llama_tiny.providers, name: package})  # fmt: skip
    real_load = registry.load
    monkeypatch.setattr(
        registry, "load", lambda kind, n: preset if (kind, n) == ("presets", "moved-tiny")
        else real_load(kind, n)
    )  # fmt: skip
    return name


@pytest.mark.parametrize(("modifier", "package"), MOVED)
def test_a_preset_naming_a_moved_feature_works_when_installed(monkeypatch, modifier, package):
    """Quantize and pipeline are first-party plugins now; presets name them as before."""
    name = _moved_preset(monkeypatch, modifier, package)
    if name not in registry.names("modifiers"):
        pytest.skip(f"{package} is not installed")
    cfg = preset_config("moved-tiny")
    layer = "quantized_linear" if name == "quantize" else "pipelined_transformer"
    assert find_configs(cfg, layer)


@pytest.mark.parametrize(("modifier", "package"), MOVED)
def test_a_preset_naming_a_moved_feature_names_its_package(
    plugin_site, monkeypatch, modifier, package
):
    plugin_site.keep_installed("axplug-attention")  # llama-tiny's rope
    name = _moved_preset(monkeypatch, modifier, package)
    with pytest.raises(
        ConfigError, match=f"^preset moved-tiny needs modifier '{name}': pip install {package}$"
    ):
        preset_config("moved-tiny")
    monkeypatch.setenv("AXPLUG_DISABLE_PLUGINS", package)
    plugin_site.keep_installed(package)
    registry.reset()
    with pytest.raises(ConfigError, match=f"'{name}' from {package}, which is disabled"):
        preset_config("moved-tiny")


def test_disabled_plugin_modifier_is_reported(monkeypatch):
    monkeypatch.setenv("AXPLUG_LOAD_PLUGINS", "")
    registry.reset()
    try:
        if "rope" in {c.name for c in registry.discover("modifiers")}:
            # A plugin's preset is disabled with its plugin (the core's needs none).
            with pytest.raises(
                registry.ComponentNotFoundError,
                match="^presets 'llama2-7b' from axplug-attention .* is disabled: "
                "AXPLUG_LOAD_PLUGINS",
            ):
                preset_config("llama2-7b")
        assert (
            main(
                [
                    "train",
                    "--preset",
                    "llama-tiny",
                    "--output-dir",
                    "/nonexistent",
                    "--print-config",
                ]
            )
            == 2
        )
        preset_config("gpt-tiny")  # core only, always available
    finally:
        monkeypatch.delenv("AXPLUG_LOAD_PLUGINS")
        registry.reset()


def test_unknown_preset_lists_installed_ones():
    with pytest.raises(LookupError, match="available presets: .*gpt-tiny"):
        preset_config("gpt-huge")


def test_mesh_rule_auto_selects_cpu_and_unknown_selectors_list_rules():
    assert detect_selector() == "cpu-8"
    name, rule = select_mesh_rule("auto")
    assert name == "cpu"
    cfg = rule.modifier()(preset_config("gpt-tiny"))
    assert cfg.mesh.mesh_shape == (-1, 1, 1, 1, 1)
    with pytest.raises(
        ConfigError,
        match=r"no installed mesh rule matches 'qpu-9000'; "
        r"installed rules: .*cpu \(cpu-\*\)",
    ):
        select_mesh_rule("qpu-9000")


def test_modifier_specs_are_parsed_and_checked():
    from axplug.modifiers import make_modifier, parse_modifier_spec

    assert parse_modifier_spec("moe:num_experts=8,top_k=2") == (
        "moe",
        {"num_experts": 8, "top_k": 2},
    )
    assert parse_modifier_spec("axplug-moe:moe") == ("axplug-moe:moe", {})
    assert parse_modifier_spec("set:overrides=['a=1', 'b=2']") == (
        "set",
        {"overrides": ["a=1", "b=2"]},
    )
    cfg = make_modifier("mesh:fsdp=-1,model=2")(preset_config("gpt-tiny"))
    assert cfg.mesh.mesh_shape == (1, -1, 1, 1, 2)
    with pytest.raises(ConfigError, match="modifier 'mesh': .*fdsp: unknown field, did you mean"):
        make_modifier("mesh:fdsp=2")
    scanned = make_modifier("scan_layers:remat_policy=full")(preset_config("gpt-tiny"))
    assert scanned.model.decoder.transformer.remat_policy == "full"
    assert scanned.model.decoder.transformer.num_layers == 2  # carried over


class _ScansItself(StackedTransformer):
    """A stack that says how it scans (here, as a RepeatedTransformer of twice as many
    layers); without the hook, scan_layers finds no StackedTransformer in the tree."""

    @classmethod
    def scanned_config(cls, cfg, *, remat_policy):
        return RepeatedTransformer.default_config().set(
            num_layers=2 * cfg.num_layers, layer=cfg.layer.clone(), remat_policy=remat_policy
        )


def test_scan_layers_asks_a_stack_class_with_scanned_config_how_it_scans():
    from axplug.modifiers import make_modifier

    cfg = preset_config("gpt-tiny")
    stack = cfg.model.decoder.transformer
    cfg.model.decoder.transformer = _ScansItself.default_config().set(
        num_layers=stack.num_layers, layer=stack.layer
    )
    scanned = make_modifier("scan_layers:remat_policy=dots")(cfg).model.decoder.transformer
    assert scanned.klass is RepeatedTransformer and scanned.remat_policy == "dots"
    assert scanned.num_layers == 4 and scanned.layer == stack.layer
    # No stack of either kind is still an error.
    cfg.model.decoder.transformer = stack.layer.clone()
    with pytest.raises(ConfigError, match="no sub-config of class StackedTransformer"):
        make_modifier("scan_layers")(cfg)


def test_train_command_writes_config_metrics_and_resumes(tmp_path, capsys):
    args = tiny_train_args(tmp_path, "input.seq_len=16", "model.decoder.dim=16")
    assert main(args) == 0
    config = (tmp_path / "config.txt").read_text().splitlines()
    assert "max_steps: 2" in config and "input.seq_len: 16" in config
    assert f"output_dir: {str(tmp_path)!r}" in config
    assert [r["step"] for r in read_jsonl(tmp_path / "metrics.jsonl")] == [2]
    assert not (tmp_path / "tensorboard").exists()  # a dashboard is a --writer of a plugin
    args[args.index("--max-steps") + 1] = "4"
    assert main(args) == 0  # resumes from step 2 and trains steps 3 and 4
    assert "done: step 4" in capsys.readouterr().out
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == [
        "step_00000002",
        "step_00000004",
    ]


def test_train_command_reports_bad_overrides_with_the_path(tmp_path, capsys):
    code = main(
        [
            "train",
            "--preset",
            "gpt-tiny",
            "--output-dir",
            str(tmp_path),
            "--set",
            "model.decoder.transformer.num_layer=3",
        ]
    )
    assert code == 2
    assert "model.decoder.transformer.num_layer: unknown field, did you mean 'num_layers'?" in (
        capsys.readouterr().err
    )
    assert not (tmp_path / "config.txt").exists()


def test_train_help_teaches_with_examples(capsys):
    assert main(["train", "--help"]) == 0
    out = capsys.readouterr().out
    assert "axplug train --preset gpt-tiny --output-dir runs/tiny" in out
    assert "--modifier" in out and "--mesh-rule" in out
