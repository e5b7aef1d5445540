"""Config objects: attrs classes that know the class they build, with path-aware errors."""

from __future__ import annotations

import copy
import difflib
import functools
import types
import typing
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, ClassVar, Self, TypeVar, Union

import attrs

from axplug.config.errors import (
    ConfigDependencyError,
    ConfigError,
    ConfigFileError,
    ConfigTypeError,
    ConfigValueError,
    RequiredFieldError,
    UnknownFieldError,
    UsageError,
    shown,
)

__all__ = [
    "REQUIRED",
    "Required",
    "ConfigError",
    "UnknownFieldError",
    "ConfigTypeError",
    "RequiredFieldError",
    "ConfigValueError",
    "ConfigFileError",
    "ConfigDependencyError",
    "UsageError",
    "ConfigBase",
    "InstantiableConfig",
    "Configurable",
    "configurable_class",
    "config_class",
    "visit",
]


class RequiredFieldValue:
    """Sentinel type for fields that must be set before instantiation."""

    _instance = None

    def __new__(cls):
        if cls._instance is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    def __repr__(self) -> str:
        return "REQUIRED"

    def __deepcopy__(self, memo):
        return self

    def __reduce__(self):
        return (RequiredFieldValue, ())


REQUIRED: Any = RequiredFieldValue()
_T = TypeVar("_T")
if TYPE_CHECKING:  # a REQUIRED field is refused at instantiation: code that reads it sees an int
    Required = typing.Annotated[_T, "required"]
else:
    Required = Union[_T, RequiredFieldValue]  # noqa: UP007 (subscriptable alias: Required[int])


_IMMUTABLE = (int, float, bool, str, bytes, type(None), RequiredFieldValue, type, frozenset)


def config_class(cls: type) -> type:
    """Turns a class body of annotated fields into a keyword-only attrs config class."""
    for name in cls.__dict__.get("__annotations__", {}):
        default = cls.__dict__.get(name, attrs.NOTHING)
        if default is attrs.NOTHING or isinstance(default, _IMMUTABLE + (tuple,)):
            if isinstance(default, tuple) and any(not isinstance(v, _IMMUTABLE) for v in default):
                setattr(cls, name, attrs.field(factory=functools.partial(copy.deepcopy, default)))
            continue
        if type(default).__name__ == "_CountingAttr":  # already an attrs.field(...)
            continue
        # Mutable defaults (sub-configs, lists) are copied per instance, never shared.
        setattr(cls, name, attrs.field(factory=functools.partial(copy.deepcopy, default)))
    return attrs.define(cls, slots=False, kw_only=True, on_setattr=attrs.setters.NO_OP, repr=False)


def _suggest(name: str, choices: list[str], cls: Any = None) -> str:
    if cls is not None and (moved := cls.RENAMED.get(name)) is not None:
        return f"; it moved to {moved}"
    close = difflib.get_close_matches(name, choices, n=1, cutoff=0.6)
    return f", did you mean '{close[0]}'?" if close else f"; known fields: {', '.join(choices)}"


def _type_name(tp: Any) -> str:
    if typing.get_origin(tp) in (Union, types.UnionType):
        names = [_type_name(a) for a in typing.get_args(tp) if a is not RequiredFieldValue]
        return names[0] if len(names) == 1 else " | ".join(names)
    if isinstance(tp, type):
        return tp.__qualname__
    return str(tp).replace("typing.", "")


def _field_types(cls: type) -> dict[str, Any]:
    """The resolved annotations of a config class (cached; {} when unresolvable)."""
    return _type_hints(cls)


# Behind a typed function: the cache's wrapper takes any Hashable, and type checkers do not
# see a config class (whose instances are unhashable attrs objects) as one.
@functools.cache
def _type_hints(cls: type) -> dict[str, Any]:
    try:
        return typing.get_type_hints(cls)
    except Exception:  # noqa: BLE001 - unresolvable annotations only disable type checks
        return {}


def _matches(value: Any, tp: Any) -> bool:
    """Whether `value` fits the annotation `tp`; permissive where the annotation is exotic."""
    if value is REQUIRED or tp is Any or isinstance(tp, (TypeVar, str, typing.ForwardRef)):
        return True
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin is Union or origin is types.UnionType:
        return any(_matches(value, a) for a in args)
    if origin is typing.Literal:
        return value in args
    if tp is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if tp is type(None) or tp is None:
        return value is None
    if origin in (list, tuple, set, frozenset, dict):
        if not isinstance(value, origin):
            return False
        if origin is dict:
            return not args or all(_matches(v, args[1]) for v in value.values())
        if origin is tuple and args and args[-1] is not Ellipsis:
            return len(args) == len(value) and all(map(_matches, value, args))
        return not args or all(_matches(v, args[0]) for v in value)
    if origin is not None and isinstance(origin, type):
        if origin.__module__ == "collections.abc" and origin.__name__ == "Callable":
            return callable(value)
        return isinstance(value, origin) and not isinstance(value, str) or origin is str
    if isinstance(tp, type):
        return isinstance(value, tp)
    return True


@config_class
class ConfigBase:
    """A mutable tree of fields; assignments are checked against the declared names and types."""

    # Fields that moved, old name -> new dotted path: a config saved before still loads
    # (`from_dict`), and setting the old name names the new path. (Unannotated: not a field.)
    RENAMED = dict[str, str]()

    if TYPE_CHECKING:  # what `config_class` (attrs) and `clone` add, spelled for type checkers
        __attrs_attrs__: ClassVar[tuple[attrs.Attribute[Any], ...]]
        _origin: str

        # A sub-config's fields are those of the class set at run time (`cfg.router.top_k`).
        def __getattr__(self, name: str) -> Any: ...

    def __setattr__(self, name: str, value: Any) -> None:
        if name.startswith("_"):
            object.__setattr__(self, name, value)
            return
        fields = attrs.fields_dict(type(self))
        if name not in fields:
            raise UnknownFieldError(
                f"{self.field_path(name)}: unknown field{_suggest(name, list(fields), type(self))}"
            )
        tp = _field_types(type(self)).get(name, Any)
        if not _matches(value, tp):
            raise ConfigTypeError(
                f"{self.field_path(name)}: expected {_type_name(tp)}, got "
                f"{type(value).__qualname__} ({shown(value)})"
            )
        if isinstance(value, ConfigBase):
            object.__setattr__(value, "_parent", (self, name))
        object.__setattr__(self, name, value)

    def field_path(self, name: str | None = None) -> str:
        """Dotted path of this config (or of its field `name`) from the root of its tree."""
        parts = [] if name is None else [name]
        node, seen = self, set()
        while (link := getattr(node, "_parent", None)) is not None and id(node) not in seen:
            seen.add(id(node))
            parent, field = link
            if getattr(parent, field, None) is not node:
                break  # moved elsewhere since; stop at the last verified link
            parts.append(field)
            node = parent
        origin = getattr(node, "_origin", None)  # where a detached clone was copied from
        if origin:
            parts.append(origin)
        if not parts:
            return type(self).__qualname__
        return ".".join(reversed(parts))

    def field_error(
        self, name: str, problem: str, error: type[ConfigError] = ConfigValueError
    ) -> ConfigError:
        """`error` whose message is `<dotted path of field name>: problem` (say the fix in it).

        The one way to report a bad value of a field; the CLI prints it as one `error:` line
        and exits 2. Raise what it returns: `raise cfg.field_error("keep_last", "...")`.
        """
        return error(f"{self.field_path(name)}: {problem}")

    def set(self, **kwargs: Any) -> Self:
        """Sets fields in place and returns self, for chaining."""
        for k, v in kwargs.items():
            setattr(self, k, v)
        return self

    def clone(self, **kwargs: Any) -> Self:
        """A deep copy with `kwargs` set; the original is untouched.

        The copy remembers the dotted path it was copied from, so errors about it still
        name the place in the user's config tree.
        """
        new = copy.deepcopy(self)
        path = self.field_path()
        if path != type(self).__qualname__:
            object.__setattr__(new, "_origin", path)
        return new.set(**kwargs)

    def located(self, path: str) -> Self:
        """A deep copy whose errors name it `path`: for a config kept in a list or a dict
        (`summary_writers[3]`), which links no parent."""
        new = copy.deepcopy(self)
        object.__setattr__(new, "_origin", path)
        return new

    def __deepcopy__(self, memo: dict) -> Self:
        new = object.__new__(type(self))
        memo[id(self)] = new
        if getattr(self, "_origin", None):
            object.__setattr__(new, "_origin", self._origin)
        for f in attrs.fields(type(self)):
            value = copy.deepcopy(getattr(self, f.name), memo)
            object.__setattr__(new, f.name, value)
            if isinstance(value, ConfigBase):
                object.__setattr__(value, "_parent", (new, f.name))
        return new

    def keys(self) -> list[str]:
        return [f.name for f in attrs.fields(type(self))]

    def items(self) -> list[tuple[str, Any]]:
        return [(k, getattr(self, k)) for k in self.keys()]

    def debug_string(self) -> str:
        """One `dotted.path: value` line per leaf field, sorted, for reading and diffing."""
        lines: list[str] = []
        _flatten(self, "", lines)
        return "\n".join(sorted(lines))

    def to_dict(self) -> dict[str, Any]:
        """A JSON-compatible dict; classes are written as `module:Qualname`."""
        from axplug.config import serialize

        return serialize.to_dict(self)

    def __repr__(self) -> str:
        body = ", ".join(f"{k}={v!r}" for k, v in self.items())
        return f"{type(self).__qualname__}({body})"


def _leaf_repr(value: Any) -> str:
    if isinstance(value, type) or callable(value) and hasattr(value, "__qualname__"):
        return f"{value.__module__}:{value.__qualname__}"
    return repr(value)


def _holds_config(value: Any) -> bool:
    if isinstance(value, ConfigBase):
        return True
    if isinstance(value, (list, tuple)):
        return any(_holds_config(v) for v in value)
    if isinstance(value, dict):
        return any(_holds_config(v) for v in value.values())
    return False


def _flatten(value: Any, path: str, out: list[str]) -> None:
    if not _holds_config(value):
        out.append(f"{path}: {_leaf_repr(value)}")
        return
    for suffix, child in _children(value):
        _flatten(child, (path + suffix).lstrip("."), out)


def _children(value: Any) -> Iterator[tuple[str, Any]]:
    if isinstance(value, ConfigBase):
        for k, v in value.items():
            yield f".{k}", v
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            yield f"[{i}]", v
    elif isinstance(value, dict):
        for k, v in value.items():
            yield f"[{k!r}]", v


def visit(cfg: Any, fn: Callable[[str, Any], None], path: str = "") -> None:
    """Calls `fn(dotted_path, value)` for every node under `cfg`, parents before children."""
    for suffix, value in _children(cfg):
        child_path = (path + suffix).lstrip(".")
        fn(child_path, value)
        if isinstance(value, (ConfigBase, list, tuple, dict)):
            visit(value, fn, child_path)


@config_class
class InstantiableConfig(ConfigBase):
    """A config that builds an object of class `klass`."""

    klass: type | None = None

    def instantiate(self, **kwargs: Any) -> Any:
        """Builds `klass(self, **kwargs)` after checking this config's REQUIRED fields."""
        path = kwargs.pop("_path", None)
        check_required(self, path)
        if self.klass is None:
            raise ConfigError(
                f"{path or self.field_path()}: no class to instantiate (klass is None)"
            )
        return self.klass(self, **kwargs)


def check_required(cfg: ConfigBase, module_path: str | None = None) -> None:
    """Raises RequiredFieldError naming the first unset field by its config path (and the
    module being built), not descending into instantiable sub-configs, which their owners
    fill and check."""
    for name, value in cfg.items():
        where = cfg.field_path(name)
        if value is REQUIRED:
            module = f" (building module {module_path})" if module_path else ""
            raise RequiredFieldError(
                f"{where}: required field is not set{module}; set it in the config or "
                f"with --set {where}=VALUE"
            )
        if isinstance(value, ConfigBase) and not isinstance(value, InstantiableConfig):
            check_required(value, module_path)


class Configurable:
    """A class built from its config: `Cls.default_config().set(...).instantiate()`."""

    @config_class
    class Config(InstantiableConfig):
        pass

    @classmethod
    def default_config(cls) -> Any:  # the class's own Config, which no annotation can name
        cfg = cls.Config()
        cfg.klass = cls
        return cfg

    @classmethod
    def check_config(cls, cfg: Any) -> None:
        """Raises a ConfigError naming the field of `cfg` that cannot work; cheap: no backend
        import, no I/O (the run calls it before building anything). Nothing by default."""

    def __init__(self, cfg: Configurable.Config):
        # A copy that keeps the path of `cfg` in its tree, for errors about its fields.
        self._config: Any = cfg.clone()  # the class's own Config

    @property
    def config(self) -> Any:  # the class's own Config
        """A copy of the config this object was built from."""
        return copy.deepcopy(self._config)


def configurable_class(cfg: Any) -> type[Configurable] | None:
    """The Configurable class a config builds (its `klass`), if it builds one."""
    klass = cfg.klass if isinstance(cfg, InstantiableConfig) else None
    return klass if isinstance(klass, type) and issubclass(klass, Configurable) else None
