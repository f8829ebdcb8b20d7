"""Typed documents that cross task boundaries: frozen dataclasses with `to_xcom()` and a checked `from_xcom()`.

XCom is untrusted input (docs/security.md): whoever may edit it could hand a task another shape. Reading a document
refuses a value that is not an object, a missing or unknown key and a value of another type than its field's,
naming the document, the field and what it holds, so a task acts on nothing it did not expect. The field lists are
the dataclasses' docstrings (docs/CONTRACTS.md points at them).

Files read back from storage (report.json, summary.json) use the same reader through `from_json(value, source)`,
which names the file too; an `OpenDocument` keeps the keys it does not model (a later version's) in `extra` and
writes them back. A number is kept as written (an int in a float field stays an int), so a document read and
written again keeps its JSON byte for byte.
"""

from __future__ import annotations

import dataclasses
import re
import types
import typing
from collections.abc import Mapping
from typing import Any, ClassVar, Self


class DocumentError(ValueError):
    """A document that is not what its type says: not an object, or a missing, unknown or mistyped field.

    When the reader found it, `source` (the file, or ""), `path` (the field, e.g. `runs.baseline.eval_loss`, or ""
    for the whole document), `problem` and `shown` (the value, for logs) say where and what; `brief` is the path and
    the problem alone, for pages that show neither storage URLs nor what a storage writer put there.
    """

    def __init__(self, message: str, *, source: str = "", path: str = "", problem: str = "",
                 shown: str = "") -> None:
        super().__init__(message)
        self.source, self.path, self.problem, self.shown = source, path, problem, shown

    def found_in(self, source: str) -> DocumentError:
        """This error, naming the file it was found in."""
        return _refused(self.path, self.problem, self.shown, source) if self.problem else self

    @property
    def brief(self) -> str:
        return ": ".join(part for part in (self.path, self.problem) if part) or str(self)


def _refused(path: str, problem: str, shown: str = "", source: str = "") -> DocumentError:
    where = ": ".join(part for part in (source, path) if part)
    return DocumentError(f"{where}: {problem}{shown}: refusing the document.", source=source, path=path,
                         problem=problem, shown=shown)


@dataclasses.dataclass(frozen=True)
class Document:
    """Base of the documents: plain JSON values out (`to_xcom`), checked values in (`from_xcom`, `from_json`)."""

    def to_xcom(self) -> dict[str, Any]:
        return {field.name: _plain(getattr(self, field.name)) for field in dataclasses.fields(self)}

    def to_json(self) -> dict[str, Any]:
        """The same values, for a file (`from_json` reads them back)."""
        return self.to_xcom()

    @classmethod
    def from_xcom(cls, value: Any) -> Self:
        """The document `value` (an XCom) holds; DocumentError naming the document and what does not fit."""
        return cls._read(value, cls.__name__, named=True)

    @classmethod
    def from_json(cls, value: Any, source: str, path: str = "") -> Self:
        """The document `value` (read from `source`, at `path` in it) holds; DocumentError naming both otherwise."""
        try:
            return cls._read(value, path, named=False)
        except DocumentError as error:
            raise error.found_in(source) from None

    @classmethod
    def _read(cls, value: Any, path: str, named: bool) -> Self:
        """The document at `path`; `named`: a nested document's fields are named after its class (an XCom's
        `PreparedRun.continued_from: PromotedVersion.eval_loss`), else by their path alone (a file's
        `runs.baseline.eval_loss`)."""
        fields, unknown = read_fields(cls, value, path, named=named)
        if unknown:
            keys = ", ".join(sorted(str(key) for key in unknown))
            raise _refused(path, f"unknown key(s) {keys} (a {cls.__name__} has "
                                 f"{', '.join(field.name for field in dataclasses.fields(cls))}); it was not "
                                 "written by this project's task of this version")
        return cls(**fields)


@dataclasses.dataclass(frozen=True)
class OpenDocument(Document):
    """A document that keeps the keys it does not model (a later version's) in `extra`, written back as read;
    the keys in `DERIVED` (what `to_xcom()` computes) are not read back."""

    extra: dict[str, Any] = dataclasses.field(default_factory=dict, kw_only=True, repr=False)

    DERIVED: ClassVar[frozenset[str]] = frozenset()

    def to_xcom(self) -> dict[str, Any]:
        own = super().to_xcom()
        del own["extra"]
        return {**own, **self.extra}

    @classmethod
    def _read(cls, value: Any, path: str, named: bool) -> Self:
        fields, unknown = read_fields(cls, value, path, rest="extra", named=named)
        return cls(**fields, extra={key: item for key, item in unknown.items() if key not in cls.DERIVED})


def read_fields(cls: type, value: Any, path: str = "", rest: str | None = None, *,
                named: bool = False) -> tuple[dict[str, Any], dict[str, Any]]:
    """The fields of the dataclass `cls` that the object `value` holds, checked (the field `rest`, which takes the
    other keys, left out), and its other keys; DocumentError naming `path` when it is no object or misses a field
    without a default."""
    if not isinstance(value, Mapping):
        raise _refused(path, f"expected a JSON object, got {type(value).__name__}: not a {cls.__name__}")
    fields = {field.name: field for field in dataclasses.fields(cls) if field.name != rest}
    missing = [name for name, field in fields.items() if name not in value and _required(field)]
    if missing:
        raise _refused(path, f"missing key(s) {', '.join(missing)}: not a complete {cls.__name__}")
    hints = typing.get_type_hints(cls)
    read = {name: _check(hints[name], value[name], _at(path, name), named) for name in fields if name in value}
    return read, {key: item for key, item in value.items() if key not in fields}


def _at(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name


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
    declared, so a frozen document holds no list of its own; a number stays as written (an int in a float field
    is kept: within a float's range, it is one)."""
    return _check(kind, value, where, named=True)


def _check(kind: Any, value: Any, where: str, named: bool) -> Any:
    origin = typing.get_origin(kind)
    if kind is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        return _one_of(kind, value, where, named)
    if isinstance(kind, type) and issubclass(kind, Document):
        return kind._read(value, f"{where}: {kind.__name__}" if named else where, named)
    if origin in (dict, Mapping) or kind in (dict, Mapping):
        return _mapping(kind, value, where, named)
    if origin in (list, tuple) or kind in (list, tuple):
        return _sequence(kind, value, where, named)
    return _scalar(kind, value, where)


def _one_of(kind: Any, value: Any, where: str, named: bool) -> Any:
    arms = typing.get_args(kind)
    if value is not None and len(arms) == 2 and type(None) in arms:  # X | None: X's own error says more
        return _check(next(arm for arm in arms if arm is not type(None)), value, where, named)
    for arm in arms:
        try:
            return _check(arm, value, where, named)
        except DocumentError:
            continue
    raise _mistyped(kind, value, where)


def _mapping(kind: Any, value: Any, where: str, named: bool) -> dict[str, Any]:
    if not isinstance(value, Mapping) or not all(isinstance(key, str) for key in value):
        raise _mistyped(kind, value, where)
    args = typing.get_args(kind)
    item = args[1] if args else Any
    return {key: _check(item, entry, f"{where}.{key}", named) for key, entry in value.items()}


def _sequence(kind: Any, value: Any, where: str, named: bool) -> list[Any] | tuple[Any, ...]:
    if not isinstance(value, (list, tuple)):
        raise _mistyped(kind, value, where)
    args = typing.get_args(kind)
    item = args[0] if args else Any
    items = [_check(item, entry, f"{where}[{index}]", named) for index, entry in enumerate(value)]
    return tuple(items) if tuple in (kind, typing.get_origin(kind)) else items


def _scalar(kind: Any, value: Any, where: str) -> Any:
    if kind is type(None) and value is None:
        return None
    if isinstance(value, bool) and kind is not bool:  # JSON's true is no number here
        raise _mistyped(kind, value, where)
    if kind is float and isinstance(value, int) and _in_float_range(value):
        return value
    if kind in (str, int, float, bool) and isinstance(value, kind):
        return value
    raise _mistyped(kind, value, where)


def _in_float_range(value: int) -> bool:
    try:
        float(value)
    except OverflowError:  # an int of 400 digits: no figure
        return False
    return True


def _mistyped(kind: Any, value: Any, where: str) -> DocumentError:
    shown = repr(value)
    shown = shown if len(shown) <= 80 else shown[:77] + "..."
    return _refused(where, f"expected {_name(kind)}, got {type(value).__name__}", f" {shown}")


def _name(kind: Any) -> str:
    """The annotation as its source spells it: `float`, `dict[str, Gate]` (no module paths)."""
    return kind.__name__ if isinstance(kind, type) else re.sub(r"\b(?:[A-Za-z_]\w*\.)+(\w+)", r"\1", str(kind))
