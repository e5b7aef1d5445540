"""Config objects: `Cls.default_config().set(...).instantiate()`, tree tools and serialization."""

from axplug.config.base import (
    REQUIRED,
    ConfigBase,
    ConfigDependencyError,
    ConfigError,
    ConfigFileError,
    ConfigTypeError,
    Configurable,
    ConfigValueError,
    InstantiableConfig,
    Required,
    RequiredFieldError,
    UnknownFieldError,
    UsageError,
    config_class,
    configurable_class,
    visit,
)
from axplug.config.overlay import apply_overlay
from axplug.config.overrides import apply_overrides, parse_value
from axplug.config.redact import has_userinfo, strip_userinfo, strip_userinfo_tree
from axplug.config.serialize import UntrustedCodeError, from_dict, resolve_class, to_dict
from axplug.config.tree import (
    ChainConfigModifier,
    ConfigModifier,
    chain,
    find_configs,
    replace_config,
)

__all__ = [
    "REQUIRED",
    "Required",
    "ConfigBase",
    "InstantiableConfig",
    "Configurable",
    "config_class",
    "configurable_class",
    "ConfigError",
    "ConfigDependencyError",
    "ConfigFileError",
    "ConfigTypeError",
    "ConfigValueError",
    "RequiredFieldError",
    "UnknownFieldError",
    "UsageError",
    "UntrustedCodeError",
    "visit",
    "find_configs",
    "replace_config",
    "ConfigModifier",
    "ChainConfigModifier",
    "chain",
    "to_dict",
    "from_dict",
    "resolve_class",
    "apply_overrides",
    "apply_overlay",
    "parse_value",
    "has_userinfo",
    "strip_userinfo",
    "strip_userinfo_tree",
]
