"""One registry type for every kind of component.

A component is a dataclass whose fields are its parameters (typed, with defaults). It is
registered under a short snake_case name and built from a YAML/omegaconf node of the form
``{name: <registered name>, <param>: <value>, ...}``. Building validates the node: unknown
names (listing the known ones and the closest match), unknown, missing or mistyped parameters
(naming the component and the field). Every registry enrols itself in :data:`REGISTRIES` when
it is created, so ``kvlab list`` prints :meth:`Registry.describe` for each one without a
hand-written list. The first lookup loads the installed plugins' ``kvlab.plugins`` entry points
(:mod:`kvlab.config.plugins`). A field declared with :func:`context_field` is no parameter: kvlab
fills it when it builds the component (``Registry.build``'s context), YAML cannot set it and
``kvlab list`` does not show it.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Callable, Mapping
from typing import Any, Generic, NamedTuple, TypeVar

from omegaconf import DictConfig, ListConfig, OmegaConf

from kvlab.config.capabilities import Capabilities, Component, RecordField
from kvlab.config.errors import ConfigError, did_you_mean
from kvlab.config.plugins import load_entry_points

T = TypeVar("T")

_MISSING = dataclasses.MISSING

# every Registry ever created, in creation order (filled by Registry.__init__)
REGISTRIES: list[Registry[Any]] = []
#: the metadata key that marks a :func:`context_field`
CONTEXT_ONLY = "kvlab_context_only"


def context_field(default: Any = None) -> Any:
    """A dataclass field that kvlab fills when it builds the component (``Registry.build(node,
    where, **context)``), such as the source of model processors a dataset measures tokens with:
    not a YAML parameter, not listed by ``kvlab list``, left out of ``repr`` and comparisons."""
    return dataclasses.field(default=default, repr=False, compare=False, metadata={CONTEXT_ONLY: True})


def parameter_fields(cls: type) -> list[dataclasses.Field]:
    """The fields of dataclass ``cls`` that YAML sets: initialised, not private (``_``), not a
    :func:`context_field`."""
    return [
        f
        for f in dataclasses.fields(cls)  # type: ignore[arg-type]
        if f.init and not f.name.startswith("_") and not f.metadata.get(CONTEXT_ONLY)
    ]


def to_plain(node: Any) -> Any:
    """Convert omegaconf containers to plain dicts/lists (resolving interpolations)."""
    if isinstance(node, DictConfig | ListConfig):
        return OmegaConf.to_container(node, resolve=True)
    return node


def _type_name(tp: Any) -> str:
    if isinstance(tp, type):
        return tp.__name__
    return str(tp).replace("typing.", "")


def _matches(value: Any, tp: Any) -> bool:
    """Whether a YAML value fits a (simple) type hint: int, float, str, bool, Literal, list, dict, unions."""
    if tp is Any:
        return True
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        return any(_matches(value, arg) for arg in typing.get_args(tp))
    if origin is typing.Literal:
        return value in typing.get_args(tp)
    if tp is type(None):
        return value is None
    if tp is bool:
        return isinstance(value, bool)
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if tp is float:
        return isinstance(value, int | float) and not isinstance(value, bool)
    if origin in (list, tuple) or tp in (list, tuple):
        if not isinstance(value, list | tuple):
            return False
        args = typing.get_args(tp)
        if not args or (origin is tuple and len(args) == 2 and args[1] is Ellipsis):
            inner = args[0] if args else Any
            return all(_matches(v, inner) for v in value)
        if origin is tuple:
            return len(args) == len(value) and all(_matches(v, a) for v, a in zip(value, args, strict=True))
        return all(_matches(v, args[0]) for v in value)
    if origin is dict or tp is dict:
        return isinstance(value, Mapping)
    if isinstance(tp, type):
        return isinstance(value, tp)
    return True


def _coerce(value: Any, tp: Any) -> Any:
    """Turn YAML lists into tuples where the field is a tuple (dataclasses stay hashable)."""
    if typing.get_origin(tp) is tuple and isinstance(value, list):
        return tuple(value)
    if tp is float and isinstance(value, int):
        return float(value)
    return value


class Description(NamedTuple):
    """One row of :meth:`Registry.describe`: the registered name, the first line of the class's
    docstring, its ``(parameter, type, default)`` triples, its capabilities and its paper."""

    name: str
    doc: str
    params: list[tuple[str, str, str]]
    capabilities: str | None
    paper: str | None


class Registry(Generic[T]):
    """Maps short names to component classes of one kind (e.g. importance scorers).

    Args:
        kind: human name of the component kind, used in messages (``"importance scorer"``).
        field: the YAML field where such components are written (``"compression.importance"``),
            used in error messages so the user knows where to look.
    """

    def __init__(self, kind: str, field: str):
        self.kind = kind
        self.field = field
        self._entries: dict[str, type[T] | Callable[..., T]] = {}
        REGISTRIES.append(self)

    def register(self, name: str) -> Callable[[type[T]], type[T]]:
        """Class decorator: ``@IMPORTANCE.register("window_attention")``."""

        def decorator(cls: type[T]) -> type[T]:
            if name in self._entries:
                raise ValueError(f"{self.kind} '{name}' is registered twice")
            self._entries[name] = cls
            cls.registry_name = name  # type: ignore[attr-defined]
            return cls

        return decorator

    def unregister(self, name: str) -> None:
        """Forget the component registered as ``name`` (a plugin reloaded in one process, a test
        that registered its own); unknown names are ignored."""
        self._entries.pop(name, None)

    def names(self) -> list[str]:
        return sorted(self._entries)

    def __contains__(self, name: str) -> bool:
        return name in self._entries

    def get(self, name: str, where: str | None = None) -> type[T]:
        """The class registered as ``name``; a :class:`ConfigError` listing known names otherwise.

        The first lookup loads the ``kvlab.plugins`` entry points (once per process), so an
        installed plugin's components are found by name.
        """
        load_entry_points()
        if name not in self._entries:
            known = ", ".join(self.names())
            raise ConfigError(
                f"Unknown {self.kind} '{name}' in {where or self.field}.{did_you_mean(name, self.names())} "
                f"Known {self.kind}s: {known}. Run `kvlab list` to see every component with its parameters."
            )
        return self._entries[name]  # type: ignore[return-value]

    def build(self, node: Any, where: str | None = None, **context: Any) -> T:
        """Build a component from ``{name: ..., params}`` (a string is shorthand for ``{name: str}``).

        ``context`` holds keyword arguments supplied by kvlab itself (not by YAML), such as a
        model's head counts; they are passed only if the class declares them as fields.
        """
        where = where or self.field
        node = to_plain(node)
        if isinstance(node, str):
            node = {"name": node}
        if not isinstance(node, Mapping) or "name" not in node:
            raise ConfigError(
                f"{where} must be a mapping with a 'name' field (one of: {', '.join(self.names())}), "
                f"got {node!r}. Example: {{name: {self.names()[0] if self.names() else 'x'}}}."
            )
        params = dict(node)
        name = params.pop("name")
        cls = self.get(name, where)
        values = validate_params(cls, params, f"{self.kind} '{name}' ({where})")
        for key, val in context.items():
            if key in {f.name for f in dataclasses.fields(cls)} and key not in values:  # type: ignore[arg-type]
                values[key] = val
        try:
            built = cls(**values)
        except (ValueError, TypeError) as exc:
            raise ConfigError(f"{self.kind} '{name}' ({where}): {exc}") from None
        if isinstance(built, Component):
            built.seal()  # a component built from a config never changes afterwards
        return built

    def describe(self) -> list[Description]:
        """A :class:`Description` of every component, by name, for ``kvlab list``.

        ``capabilities``: what a pipeline component declares (:meth:`Capabilities.describe
        <kvlab.config.capabilities.Capabilities.describe>`, e.g. ``chunked_prefill``); None for
        registries of other things (datasets, models, protocols). ``paper``: the class's ``paper``
        attribute (:mod:`kvlab.config.papers`), None when it follows none.
        """
        rows = []
        for name in self.names():
            cls = self._entries[name]
            doc = (cls.__doc__ or "").strip().splitlines()
            params = []
            if dataclasses.is_dataclass(cls):
                hints = typing.get_type_hints(cls)
                for f in parameter_fields(cls):
                    if f.default is not _MISSING:
                        default = repr(f.default)
                    elif f.default_factory is not _MISSING:  # type: ignore[misc]
                        default = repr(f.default_factory())  # type: ignore[misc]
                    else:
                        default = "(required)"
                    params.append((f.name, _type_name(hints.get(f.name, Any)), default))
            declared = getattr(cls, "capabilities", None)  # registries hold more than components
            capabilities = declared.describe() if isinstance(declared, Capabilities) else None
            paper = getattr(cls, "paper", None)
            rows.append(Description(name, doc[0] if doc else "", params, capabilities, paper))
        return rows


def record_fields() -> dict[str, RecordField]:
    """Every prediction-record field a registered component declares (``Component.record_fields``),
    by name: what :mod:`kvlab.metrics.run` aggregates (components of plugins not imported in this
    process are not among them)."""
    fields: dict[str, RecordField] = {}
    for registry in REGISTRIES:
        for entry in registry._entries.values():
            if isinstance(entry, type) and issubclass(entry, Component):
                fields.update(entry.record_fields)
    return fields


def validate_params(cls: type, params: Mapping[str, Any], where: str) -> dict[str, Any]:
    """Check ``params`` against the dataclass fields of ``cls``; return coerced keyword arguments.

    Raises :class:`ConfigError` naming ``where`` and the field for unknown, missing or mistyped
    parameters.
    """
    if not dataclasses.is_dataclass(cls):
        return dict(params)
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in parameter_fields(cls)}
    for key in params:
        if key not in fields:
            allowed = ", ".join(fields) or "none"
            raise ConfigError(
                f"{where} has no parameter '{key}'.{did_you_mean(key, fields)} "
                f"Its parameters are: {allowed}. Remove the field or fix its spelling."
            )
    values: dict[str, Any] = {}
    for key, f in fields.items():
        if key in params:
            value = params[key]
            tp = hints.get(key, Any)
            if not _matches(value, tp):
                raise ConfigError(
                    f"{where}: parameter '{key}' must be {_type_name(tp)}, got {value!r} "
                    f"({type(value).__name__}). Fix the value in the config."
                )
            values[key] = _coerce(value, tp)
        elif f.default is _MISSING and f.default_factory is _MISSING:  # type: ignore[misc]
            raise ConfigError(
                f"{where} is missing the required parameter '{key}' ({_type_name(hints.get(key, Any))}). "
                f"Add `{key}: <value>` to its config node."
            )
    return values
