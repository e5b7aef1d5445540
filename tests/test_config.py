"""Config objects: fields, errors with dotted paths, tree tools, serialization, overrides."""

import json

import pytest

from axplug.config import (
    REQUIRED,
    ConfigBase,
    ConfigError,
    ConfigModifier,
    ConfigTypeError,
    Configurable,
    InstantiableConfig,
    Required,
    RequiredFieldError,
    UnknownFieldError,
    apply_overrides,
    chain,
    config_class,
    find_configs,
    from_dict,
    parse_value,
    replace_config,
    to_dict,
    visit,
)
from axplug.layers import CausalLM, FeedForward, RepeatedTransformer


class Dense(Configurable):
    @config_class
    class Config(Configurable.Config):
        input_dim: Required[int] = REQUIRED
        hidden_dim: Required[int] = REQUIRED
        activation: str = "silu"
        dropout: float = 0.0
        shape: tuple[int, ...] = (1, 2)
        tags: list[str] = []
        maybe: int | None = None


class Experts(Configurable):
    @config_class
    class Config(Configurable.Config):
        input_dim: Required[int] = REQUIRED
        hidden_dim: Required[int] = REQUIRED
        num_experts: int = 4
        activation: str = "gelu"


class Block(Configurable):
    @config_class
    class Config(Configurable.Config):
        feed_forward: InstantiableConfig = Dense.default_config()
        extra: list = []

    def __init__(self, cfg):
        super().__init__(cfg)
        self.feed_forward = cfg.feed_forward.instantiate()


class Model(Configurable):
    @config_class
    class Config(Configurable.Config):
        block: Block.Config = Block.default_config()
        num_layers: int = 2


@config_class
class Options(ConfigBase):
    level: int = 1
    name: str = "x"


class Holder(Configurable):
    @config_class
    class Config(Configurable.Config):
        options: Options = Options()
        pairs: tuple[tuple[int, int], ...] = ((1, 2),)
        factory: type | None = None
        label: Required[str] = REQUIRED


def model_config():
    cfg = Model.default_config()
    cfg.block.feed_forward.set(input_dim=8, hidden_dim=16)
    return cfg


def test_default_config_knows_class_set_returns_self_and_instantiate_builds():
    cfg = Dense.default_config()
    assert cfg.klass is Dense
    assert cfg.set(input_dim=3, hidden_dim=4) is cfg
    obj = cfg.instantiate()
    assert isinstance(obj, Dense)
    assert obj.config.hidden_dim == 4
    obj.config.hidden_dim = 99  # a copy: the object's config cannot be changed behind its back
    assert obj.config.hidden_dim == 4


def test_mutable_defaults_are_not_shared_between_configs():
    a, b = Model.default_config(), Model.default_config()
    assert a.block is not b.block
    a.block.feed_forward.tags.append("x")
    assert b.block.feed_forward.tags == []


def test_required_field_error_names_the_dotted_path():
    cfg = Model.default_config()
    cfg.block.feed_forward.set(input_dim=8)
    with pytest.raises(RequiredFieldError, match=r"^block\.feed_forward\.hidden_dim: required"):
        cfg.block.instantiate()


def test_required_error_in_module_tree_names_config_and_module_paths():
    cfg = CausalLM.default_config()
    cfg.decoder.set(vocab_size=16, dim=8)
    cfg.decoder.transformer.set(num_layers=1)
    cfg.decoder.transformer.layer.attention.set(num_heads=2)
    with pytest.raises(RequiredFieldError) as err:
        cfg.instantiate()
    msg = str(err.value)
    assert msg.startswith("decoder.transformer.layer.feed_forward.hidden_dim: required")
    assert "model.decoder.transformer.layer0.feed_forward" in msg
    assert "--set decoder.transformer.layer.feed_forward.hidden_dim=" in msg


def test_unknown_field_error_has_path_and_suggestion():
    cfg = model_config()
    with pytest.raises(UnknownFieldError) as err:
        cfg.block.feed_forward.hiden_dim = 3
    assert str(err.value) == (
        "block.feed_forward.hiden_dim: unknown field, did you mean 'hidden_dim'?"
    )
    with pytest.raises(UnknownFieldError, match="known fields"):
        cfg.block.feed_forward.set(zzzzzz=1)


def test_wrong_type_error_names_path_expected_and_given():
    cfg = model_config()
    with pytest.raises(ConfigTypeError) as err:
        cfg.block.feed_forward.set(hidden_dim="16")
    assert str(err.value) == "block.feed_forward.hidden_dim: expected int, got str ('16')"
    with pytest.raises(ConfigTypeError, match="expected int, got bool"):
        cfg.block.feed_forward.hidden_dim = True
    with pytest.raises(ConfigTypeError, match=r"expected tuple\[int, \.\.\.\]"):
        cfg.block.feed_forward.shape = (1, "a")
    with pytest.raises(ConfigTypeError, match="maybe: expected int | None"):
        cfg.block.feed_forward.maybe = 1.5
    cfg.block.feed_forward.dropout = 1  # an int is a valid float
    cfg.block.feed_forward.maybe = None


def test_clone_is_deep_and_leaves_original_untouched():
    cfg = model_config()
    other = cfg.clone(num_layers=5)
    other.block.feed_forward.hidden_dim = 99
    assert cfg.num_layers == 2 and cfg.block.feed_forward.hidden_dim == 16
    assert other.block.feed_forward.field_path("x") == "block.feed_forward.x"


def test_visit_reaches_every_node_in_order():
    cfg = model_config()
    cfg.block.extra = [Dense.default_config()]
    paths = []
    visit(cfg, lambda p, v: paths.append(p))
    assert paths.index("block") < paths.index("block.feed_forward")
    assert "block.feed_forward.hidden_dim" in paths
    assert "block.extra[0].activation" in paths


def test_debug_string_is_one_sorted_line_per_leaf():
    cfg = model_config()
    lines = cfg.debug_string().splitlines()
    assert lines == sorted(lines)
    assert "block.feed_forward.hidden_dim: 16" in lines
    assert "block.feed_forward.shape: (1, 2)" in lines
    assert "block.feed_forward.klass: test_config:Dense" in lines
    assert "num_layers: 2" in lines
    assert len(lines) == len({line.split(":")[0] for line in lines})
    cfg.block.feed_forward.hidden_dim = 17
    diff = set(cfg.debug_string().splitlines()) ^ set(lines)
    assert diff == {"block.feed_forward.hidden_dim: 16", "block.feed_forward.hidden_dim: 17"}


def test_to_dict_from_dict_round_trip_exactly_through_json():
    cfg = model_config()
    cfg.block.extra = [Experts.default_config().set(num_experts=8)]
    cfg.block.feed_forward.shape = (3, 4)
    holder = Holder.default_config().set(factory=Dense, pairs=((1, 2), (3, 4)))
    holder.options.level = 7
    for original in (cfg, holder, CausalLM.default_config()):
        data = json.loads(json.dumps(to_dict(original)))
        restored = from_dict(data, trusted=True)  # this module's classes
        assert restored == original
        assert restored.debug_string() == original.debug_string()
    assert from_dict(to_dict(holder), trusted=True).pairs == ((1, 2), (3, 4))
    assert from_dict(to_dict(holder), trusted=True).factory is Dense
    assert from_dict(to_dict(holder), trusted=True).label is REQUIRED
    assert from_dict(to_dict(holder.clone(label="REQUIRED")), trusted=True).label == "REQUIRED"
    assert to_dict(cfg)["klass"] == "test_config:Model"


def test_from_dict_fails_on_unknown_class_and_field():
    data = to_dict(model_config())
    data["block"]["feed_forward"]["klass"] = "no_such_module:Nope"
    with pytest.raises(ConfigError, match=r"block\.feed_forward\.klass: unknown class 'no_such"):
        from_dict(data, trusted=True)
    data = to_dict(model_config())
    data["block"]["feed_forward"]["hiden_dim"] = 3
    with pytest.raises(UnknownFieldError, match=r"block\.feed_forward\.hiden_dim.*'hidden_dim'"):
        from_dict(data, trusted=True)
    with pytest.raises(ConfigError, match="not a configurable class"):
        from_dict({"klass": "json:dumps"}, trusted=True)


def test_from_dict_accepts_registry_names():
    data = to_dict(FeedForward.default_config())
    data["klass"] = "feed_forward"  # the core's own entry point name
    assert from_dict(data).klass is FeedForward


def test_untrusted_data_names_no_code_outside_axplug_and_its_plugins(monkeypatch):
    """A config from a checkpoint or a file is data: crafted class names run nothing."""
    import os

    from axplug.config import UntrustedCodeError
    from axplug.input import IteratorInput

    called = []
    monkeypatch.setattr(os, "abort", lambda: called.append("abort"))
    monkeypatch.setattr(os, "spawnve", lambda *a: called.append("spawnve"))
    crafted = to_dict(CausalLM.default_config())
    crafted["config_class"] = "os:abort"
    with pytest.raises(UntrustedCodeError, match=r"config_class: 'os:abort' names code outside"):
        from_dict(crafted)
    with pytest.raises(UntrustedCodeError, match=r"klass: 'json:dumps'"):
        from_dict({"klass": "json:dumps"})
    data = to_dict(IteratorInput.default_config().set(make_iterator="os:spawnve"))
    data["kwargs"] = {"mode": 0, "file": "/bin/sh", "args": ["sh", "-c", "true"], "env": {}}
    with pytest.raises(UntrustedCodeError, match=r"make_iterator: 'os:spawnve'"):
        from_dict(data)
    assert called == []
    # The user's own config, and the core's and plugins' classes, load as before.
    assert from_dict(to_dict(CausalLM.default_config())) == CausalLM.default_config()
    ok = IteratorInput.default_config().set(make_iterator="axplug.input.text:bundled_corpus_path")
    assert from_dict(to_dict(ok)).make_iterator == "axplug.input.text:bundled_corpus_path"
    assert from_dict(data, trusted=True).make_iterator == "os:spawnve"  # not resolved here
    # A class that is not a config class is refused even where code may be named.
    with pytest.raises(ConfigError, match="is not a config class"):
        from_dict({"config_class": "axplug.config:to_dict"})


def test_replace_config_swaps_every_match_and_carries_dims():
    cfg = model_config()
    cfg.block.extra = [Block.default_config()]
    cfg.block.extra[0].feed_forward.set(input_dim=4, hidden_dim=6)
    new = replace_config(cfg, target=Dense, new_cfg=Experts.default_config())
    assert cfg.block.feed_forward.klass is Dense  # the input is untouched
    assert new.block.feed_forward.klass is Experts
    assert (new.block.feed_forward.input_dim, new.block.feed_forward.hidden_dim) == (8, 16)
    assert new.block.extra[0].feed_forward.klass is Experts
    assert new.block.extra[0].feed_forward.input_dim == 4
    # Shared fields left at the new class's default are carried; fields set on new_cfg win...
    assert new.block.feed_forward.activation == "silu"
    relu = Experts.default_config().set(activation="relu", num_experts=2)
    kept = replace_config(cfg, target=Dense, new_cfg=relu)
    assert (kept.block.feed_forward.activation, kept.block.feed_forward.num_experts) == ("relu", 2)
    # ...unless named in carry.
    carried = replace_config(cfg, target=Dense, new_cfg=relu, carry=["activation"])
    assert carried.block.feed_forward.activation == "silu"
    assert new.block.feed_forward is not new.block.extra[0].feed_forward


def test_replace_config_owned_fields_reset_on_a_second_application():
    # A modifier swapping Experts in, applied again with num_experts back at its default:
    # without `owned` the old value would be carried and the option could never be reset.
    cfg = model_config()
    first = replace_config(cfg, target=Dense, new_cfg=Experts.default_config().set(num_experts=2))
    default_experts = Experts.default_config()
    again = replace_config(first, target=Experts, new_cfg=default_experts)
    assert again.block.feed_forward.num_experts == 2  # carried: the trap
    owned = replace_config(first, target=Experts, new_cfg=default_experts, owned=["num_experts"])
    assert owned.block.feed_forward.num_experts == default_experts.num_experts
    assert owned.block.feed_forward.input_dim == 8  # what it does not own still carries


def test_replace_config_on_a_deep_model_tree_by_registry_name():
    cfg = CausalLM.default_config()
    cfg.decoder.transformer.layer.feed_forward.set(hidden_dim=64, activation="gelu")
    new_ff = FeedForward.default_config().set(gated=False)
    new = replace_config(cfg, target="feed_forward", new_cfg=new_ff)
    ff = new.decoder.transformer.layer.feed_forward
    assert ff.gated is False and ff.hidden_dim == 64
    stacked = replace_config(
        cfg, target="stacked_transformer", new_cfg=RepeatedTransformer.default_config()
    )
    assert stacked.decoder.transformer.klass is RepeatedTransformer
    assert stacked.decoder.transformer.layer.feed_forward.hidden_dim == 64  # REQUIRED carried
    assert [p for p, _ in find_configs(new, FeedForward)] == [
        "decoder.transformer.layer.feed_forward"
    ]


def test_replace_config_without_match_fails_unless_allowed():
    with pytest.raises(ConfigError, match="no sub-config of class Experts"):
        replace_config(model_config(), target=Experts, new_cfg=Dense.default_config())
    # A match that `where` rejects is reported as such, with its path (not "none found").
    with pytest.raises(
        ConfigError,
        match=r"1 sub-config\(s\) of class Dense found, but `where` rejected every one "
        r"\(paths: block.feed_forward\); .*whose path is \"\"",
    ):
        replace_config(
            model_config(), target=Dense, new_cfg=Dense.default_config(), where=lambda p, c: False
        )
    root = Dense.default_config()
    with pytest.raises(ConfigError, match=r'paths: ""'):
        replace_config(root, target=Dense, new_cfg=root, where=lambda p, c: p != "")
    cfg = model_config()
    assert (
        replace_config(cfg, target=Experts, new_cfg=Dense.default_config(), missing_ok=True) == cfg
    )


def test_replace_config_where_narrows_the_match():
    cfg = model_config()
    cfg.block.extra = [Dense.default_config(), Dense.default_config()]
    new = replace_config(
        cfg, target=Dense, new_cfg=Experts.default_config(), where=lambda p, c: p.endswith("[1]")
    )
    assert [c.klass for c in new.block.extra] == [Dense, Experts]
    assert new.block.feed_forward.klass is Dense


class SetLayers(ConfigModifier):
    @config_class
    class Config(ConfigModifier.Config):
        num_layers: int = 4

    def __call__(self, cfg):
        return cfg.clone(num_layers=self._config.num_layers)


class UseExperts(ConfigModifier):
    def __call__(self, cfg):
        return replace_config(cfg, target=Dense, new_cfg=Experts.default_config())


def test_modifiers_compose_with_chain_and_do_not_mutate():
    cfg = model_config()
    modifier = chain(
        SetLayers.default_config().set(num_layers=6).instantiate(),
        UseExperts.default_config().instantiate(),
    )
    new = modifier(cfg)
    assert new.num_layers == 6 and new.block.feed_forward.klass is Experts
    assert cfg.num_layers == 2 and cfg.block.feed_forward.klass is Dense
    with pytest.raises(ConfigError, match="is not a ConfigModifier"):
        chain(SetLayers.default_config().instantiate(), "oops")


@pytest.mark.parametrize(
    "text, value",
    [
        ("8", 8),
        ("1e-3", 1e-3),
        ("true", True),
        ("False", False),
        ("None", None),
        ("[1, 2]", [1, 2]),
        ("'a b'", "a b"),
        ("silu", "silu"),
        ("__import__('os')", "__import__('os')"),
    ],
)
def test_parse_value_is_a_safe_literal_parser(text, value):
    assert parse_value(text) == value


def test_apply_overrides_sets_nested_values_on_a_copy():
    cfg = model_config()
    new = apply_overrides(
        cfg,
        [
            "num_layers=8",
            "block.feed_forward.dropout=0.1",
            "block.feed_forward.shape=[5, 6]",
            "block.feed_forward.activation=gelu",
            "block.feed_forward.maybe=None",
        ],
    )
    ff = new.block.feed_forward
    assert new.num_layers == 8 and ff.dropout == 0.1 and ff.shape == (5, 6)
    assert ff.activation == "gelu" and ff.maybe is None
    assert cfg.num_layers == 2


def test_apply_overrides_errors_name_the_path():
    cfg = model_config()
    with pytest.raises(
        UnknownFieldError, match=r"^block\.feed_forwrd: unknown field, did you mean"
    ):
        apply_overrides(cfg, ["block.feed_forwrd.hidden_dim=3"])
    with pytest.raises(UnknownFieldError, match=r"^block\.feed_forward\.hiden_dim: unknown field"):
        apply_overrides(cfg, ["block.feed_forward.hiden_dim=3"])
    with pytest.raises(ConfigTypeError, match=r"block\.feed_forward\.hidden_dim: expected int"):
        apply_overrides(cfg, ["block.feed_forward.hidden_dim=big"])
    with pytest.raises(ConfigError, match="expected PATH=VALUE"):
        apply_overrides(cfg, ["num_layers"])
    with pytest.raises(ConfigError, match="num_layers: is not a config"):
        apply_overrides(cfg, ["num_layers.x=1"])


def test_instantiate_without_class_fails_with_path():
    cfg = model_config()
    cfg.block.feed_forward.klass = None
    with pytest.raises(ConfigError, match=r"block\.feed_forward: no class to instantiate"):
        cfg.block.feed_forward.instantiate()
