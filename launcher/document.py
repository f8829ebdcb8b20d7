"""Typed documents that cross task boundaries: frozen dataclasses with `to_xcom()` and a checked `from_xcom()`.

XCom is untrusted input (docs/security.md): whoever may edit it could hand a task another shape. Reading a document
refuses a value that is not an object, a missing or unknown key and a value of another type than its field's,
naming the document, the field and what it holds, so a task acts on nothing it did not expect. The field lists are
the dataclasses' docstrings (docs/CONTRACTS.md points at them).
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Mapping
from typing import Any, Self


class DocumentError(ValueError):
    """An XCom document that is not what its type says: not an object, or a missing, unknown or mistyped field."""


@dataclasses.dataclass(frozen=True)
class Document:
    """Base of the documents: plain JSON values out (`to_xcom`), checked values in (`from_xcom`)."""

    def to_xcom(self) -> dict[str, Any]:
        return {field.name: _plain(getattr(self, field.name)) for field in dataclasses.fields(self)}

    @classmethod
    def from_xcom(cls, value: Any) -> Self:
        """The document `value` (an XCom) holds; DocumentError naming what does not fit."""
        name = cls.__name__
        if not isinstance(value, Mapping):
            raise DocumentError(f"{name}: expected a JSON object, got {type(value).__name__}: refusing it.")
        fields = {field.name: field for field in dataclasses.fields(cls)}
        unknown = sorted(str(key) for key in value if key not in fields)
        if unknown:
            raise DocumentError(f"{name}: unknown key(s) {', '.join(unknown)} (a {name} has {', '.join(fields)}): "
                                "refusing it; it was not written by this project's task of this version.")
        missing = [key for key, field in fields.items() if key not in value and _required(field)]
        if missing:
            raise DocumentError(f"{name}: missing key(s) {', '.join(missing)}: refusing it.")
        hints = typing.get_type_hints(cls)
        return cls(**{key: checked(hints[key], value[key], f"{name}.{key}") for key in fields if key in value})


def _required(field: dataclasses.Field) -> bool:
    return field.default is dataclasses.MISSING and field.default_factory is dataclasses.MISSING


def _plain(value: Any) -> Any:
    if isinstance(value, Document):
        return value.to_xcom()
    if isinstance(value, (list, tuple)):
        return [_plain(item) for item in value]
    if isinstance(value, Mapping):
        return {key: _plain(item) for key, item in value.items()}
    return value


def checked(kind: Any, value: Any, where: str) -> Any:
    """`value` as the annotation `kind` says (str, int, float, bool, None, unions, dict[str, X], list[X],
    tuple[X, ...], a Document, Any); DocumentError naming `where` otherwise. Lists become tuples where a tuple is
    declared, so a frozen document holds no list of its own."""
    origin = typing.get_origin(kind)
    if kind is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        return _one_of(kind, value, where)
    if isinstance(kind, type) and issubclass(kind, Document):
        try:
            return kind.from_xcom(value)
        except DocumentError as error:  # a nested document's error, named from the outermost one
            raise DocumentError(f"{where}: {error}") from None
    if origin in (dict, Mapping) or kind in (dict, Mapping):
        return _mapping(kind, value, where)
    if origin in (list, tuple) or kind in (list, tuple):
        return _sequence(kind, value, where)
    return _scalar(kind, value, where)


def _one_of(kind: Any, value: Any, where: str) -> Any:
    arms = typing.get_args(kind)
    if value is not None and len(arms) == 2 and type(None) in arms:  # X | None: X's own error says more
        return checked(next(arm for arm in arms if arm is not type(None)), value, where)
    for arm in arms:
        try:
            return checked(arm, value, where)
        except DocumentError:
            continue
    raise _mistyped(kind, value, where)


def _mapping(kind: Any, value: Any, where: str) -> dict[str, Any]:
    if not isinstance(value, Mapping) or not all(isinstance(key, str) for key in value):
        raise _mistyped(kind, value, where)
    args = typing.get_args(kind)
    item = args[1] if args else Any
    return {key: checked(item, entry, f"{where}.{key}") for key, entry in value.items()}


def _sequence(kind: Any, value: Any, where: str) -> list[Any] | tuple[Any, ...]:
    if not isinstance(value, (list, tuple)):
        raise _mistyped(kind, value, where)
    args = typing.get_args(kind)
    item = args[0] if args else Any
    items = [checked(item, entry, f"{where}[{index}]") for index, entry in enumerate(value)]
    return tuple(items) if tuple in (kind, typing.get_origin(kind)) else items


def _scalar(kind: Any, value: Any, where: str) -> Any:
    if kind is type(None) and value is None:
        return None
    if isinstance(value, bool) and kind is not bool:  # JSON's true is no number here
        raise _mistyped(kind, value, where)
    if kind is float and isinstance(value, int):
        return float(value)
    if kind in (str, int, float, bool) and isinstance(value, kind):
        return value
    raise _mistyped(kind, value, where)


def _mistyped(kind: Any, value: Any, where: str) -> DocumentError:
    shown = repr(value)
    shown = shown if len(shown) <= 80 else shown[:77] + "..."
    return DocumentError(f"{where}: expected {getattr(kind, '__name__', kind)}, got {type(value).__name__} {shown}: "
                         "refusing the document.")
