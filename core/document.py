"""Typed documents that cross task boundaries: frozen dataclasses with `to_xcom()` and a checked `from_xcom()`.

XCom is untrusted input (docs/security.md): whoever may edit it could hand a task another shape. Reading a document
refuses a value that is not an object, a missing or unknown key and a value of another type than its field's,
naming the document, the field and what it holds, so a task acts on nothing it did not expect. The field lists are
the dataclasses' docstrings (docs/CONTRACTS.md points at them).

pydantic checks the types (docs/layout.md, "One validation library"): each document class gives it a schema of its
fields, built once per class from the field annotations; this module turns pydantic's first error, by its field
path (`loc`), into the project's message. Strict scalars: `"4"` is no int and `true` no number. A number is kept as
written (an int in a float field stays an int), so a document read and written again keeps its JSON byte for byte.

Files read back from storage (report.json, summary.json) use the same reader through `from_json(value, source)`,
which names the file too; an `OpenDocument` keeps the keys it does not model (a later version's) in `extra` and
writes them back.
"""

from __future__ import annotations

import dataclasses
import functools
import operator
import re
import types
import typing
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Annotated, Any, ClassVar, Self

if TYPE_CHECKING:  # pydantic is imported on a document's first read: the launcher's GPU tools run without it
    from pydantic import TypeAdapter
    from pydantic_core import core_schema


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
    """Base of the documents: plain JSON values out (`to_xcom`), checked values in (`from_xcom`, `from_json`).

    `REST` names the field that takes the keys the document does not model; without one, such keys are refused.
    """

    REST: ClassVar[str | None] = None

    def to_xcom(self) -> dict[str, Any]:
        return {field.name: _plain(getattr(self, field.name)) for field in dataclasses.fields(self)}

    def to_json(self) -> dict[str, Any]:
        """The same values, for a file (`from_json` reads them back)."""
        return self.to_xcom()

    @classmethod
    def from_xcom(cls, value: Any) -> Self:
        """The document `value` (an XCom) holds; DocumentError naming the document and what does not fit."""
        return _validated(cls, value, cls.__name__, named=True)

    @classmethod
    def from_json(cls, value: Any, source: str, path: str = "") -> Self:
        """The document `value` (read from `source`, at `path` in it) holds; DocumentError naming both otherwise.
        A nested document's fields are named by their path alone (`runs.baseline.eval_loss`), where an XCom's name
        its class too (`PreparedRun.continued_from: PromotedVersion.eval_loss`)."""
        try:
            return _validated(cls, value, path, named=False)
        except DocumentError as error:
            raise error.found_in(source) from None

    @classmethod
    def _build(cls, fields: dict[str, Any], others: dict[str, Any]) -> Self:
        """The document from its checked fields and the keys it does not model (only with a `REST` field)."""
        return cls(**fields, **({cls.REST: others} if cls.REST else {}))

    @classmethod
    def __get_pydantic_core_schema__(cls, source: Any, handler: Any) -> core_schema.CoreSchema:
        """The document's schema for pydantic: its fields checked, then the document built."""
        fields = _fields_schema(cls, handler, extra="allow" if cls.REST else "forbid")
        from pydantic_core import core_schema

        return core_schema.no_info_after_validator_function(functools.partial(_built, cls), fields)


@dataclasses.dataclass(frozen=True)
class OpenDocument(Document):
    """A document that keeps the keys it does not model (a later version's) in `extra`, written back as read;
    the keys in `DERIVED` (what `to_xcom()` computes) are not read back."""

    extra: dict[str, Any] = dataclasses.field(default_factory=dict, kw_only=True, repr=False)

    REST: ClassVar[str | None] = "extra"
    DERIVED: ClassVar[frozenset[str]] = frozenset()

    def to_xcom(self) -> dict[str, Any]:
        own = super().to_xcom()
        del own["extra"]
        return {**own, **self.extra}

    @classmethod
    def _build(cls, fields: dict[str, Any], others: dict[str, Any]) -> Self:
        return cls(**fields, extra={key: item for key, item in others.items() if key not in cls.DERIVED})


def read_fields(cls: type, value: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """The fields of the dataclass `cls` that the object `value` holds, checked, and its other keys, left to their
    own readers; DocumentError when it is no object, misses a field without a default or holds a mistyped one."""
    checked_value = _checked(_fields_reader(cls), value, functools.partial(_explained_fields, cls, value, where="",
                                                                          named=False))
    names = {field.name for field in dataclasses.fields(cls)}
    return ({key: item for key, item in checked_value.items() if key in names},
            {key: item for key, item in checked_value.items() if key not in names})


def checked(kind: Any, value: Any, where: str) -> Any:
    """`value` as the annotation `kind` says (str, int, float, bool, None, unions, dict[str, X], list[X],
    tuple[X, ...], a Document, Any); DocumentError naming `where` otherwise. Lists become tuples where a tuple is
    declared, so a frozen document holds no list of its own; a number stays as written."""
    return _checked(_adapter(kind), value, functools.partial(_explained, kind, value, where=where, named=True))


def _validated(cls: type[Document], value: Any, where: str, named: bool) -> Any:
    return _checked(_adapter(cls), value, functools.partial(_explained_fields, cls, value, where=where, named=named))


def _checked(adapter: TypeAdapter, value: Any, explained: Callable[..., ValueError]) -> Any:
    """`value` as `adapter` validates it; else the error `explained(errors, depth=0)` makes of its errors: a
    DocumentError, or a document's own refusal as it raised it."""
    from pydantic import ValidationError

    try:
        return adapter.validate_python(value)
    except ValidationError as invalid:
        raise explained(invalid.errors(include_url=False, include_input=False), depth=0) from None


_OWN_CHECK = "document_own_check"  # pydantic's error type for a document's own refusal


def _built(cls: type[Document], checked_fields: dict[str, Any]) -> Document:
    names = {field.name for field in dataclasses.fields(cls) if field.name != cls.REST}
    try:
        return cls._build({key: item for key, item in checked_fields.items() if key in names},
                          {key: item for key, item in checked_fields.items() if key not in names})
    except ValueError as error:  # its own check (`__post_init__`): raised as it was, if it is the first error
        from pydantic_core import PydanticCustomError

        raise PydanticCustomError(_OWN_CHECK, "{error}", {"error": error}) from None


def _fields_schema(cls: type, handler: Any, extra: str) -> core_schema.CoreSchema:
    """The dataclass `cls`'s fields as a typed dict: each field's annotation as written (`_as_written`), a field
    with a default optional, other keys refused (`forbid`) or kept (`allow`)."""
    from pydantic_core import core_schema

    hints = typing.get_type_hints(cls)
    rest = getattr(cls, "REST", None)
    fields = {field.name: core_schema.typed_dict_field(handler.generate_schema(_as_written(hints[field.name])),
                                                       required=_required(field))
              for field in dataclasses.fields(cls) if field.name != rest}
    return core_schema.typed_dict_schema(fields, extra_behavior=extra)


@functools.cache
def _adapter(kind: Any) -> TypeAdapter:
    """pydantic's validator of `kind`, built once."""
    from pydantic import TypeAdapter

    return TypeAdapter(kind if isinstance(kind, type) and issubclass(kind, Document) else _as_written(kind))


@functools.cache
def _fields_reader(cls: type) -> TypeAdapter:
    """pydantic's validator of `cls`'s fields, its other keys kept (`read_fields`), built once."""
    from pydantic import GetPydanticSchema, TypeAdapter

    return TypeAdapter(Annotated[dict, GetPydanticSchema(lambda _source, handler: _fields_schema(cls, handler,
                                                                                                   "allow"))])


def _number(value: Any) -> int | float:
    """A JSON number as written: an int in a float field stays an int (within a float's range, it is one)."""
    if isinstance(value, float) or (isinstance(value, int) and not isinstance(value, bool) and _in_float_range(value)):
        return value
    from pydantic_core import PydanticCustomError

    raise PydanticCustomError("float_type", "expected float")


def _in_float_range(value: int) -> bool:
    try:
        float(value)
    except OverflowError:  # an int of 400 digits: no figure
        return False
    return True


@functools.cache
def _scalars() -> dict[Any, Any]:
    from pydantic import PlainValidator, Strict

    return {str: Annotated[str, Strict()], int: Annotated[int, Strict()], bool: Annotated[bool, Strict()],
            float: Annotated[float, PlainValidator(_number)], dict: dict[Annotated[str, Strict()], Any],
            Mapping: dict[Annotated[str, Strict()], Any]}


def _as_written(kind: Any) -> Any:
    """The annotation `kind` for pydantic: strict scalars, a float kept as written, string keys, unions tried left
    to right (the first arm that fits is the value's)."""
    scalars = _scalars()
    if kind in scalars:
        return scalars[kind]
    origin, args = typing.get_origin(kind), typing.get_args(kind)
    written = tuple(arg if arg is Ellipsis else _as_written(arg) for arg in args)
    if origin in (typing.Union, types.UnionType):
        return Annotated[functools.reduce(operator.or_, written), _left_to_right_marker()]
    if (origin or kind) in (list, tuple):
        return Annotated[origin[written] if args else kind, _json_array_marker()]
    return origin[written] if args else kind


def _json_array(value: Any) -> list[Any] | tuple[Any, ...]:
    """A list or a tuple, for a list or a tuple field (pydantic's own take sets and generators too)."""
    if isinstance(value, (list, tuple)):
        return value
    from pydantic_core import PydanticCustomError

    raise PydanticCustomError("list_type", "expected a JSON array")


def _left_to_right(source: Any, handler: Callable[[Any], core_schema.CoreSchema]) -> core_schema.CoreSchema:
    schema = handler(source)
    union = schema["schema"] if schema["type"] == "nullable" else schema
    if union["type"] == "union":
        union["mode"] = "left_to_right"
    return schema


@functools.cache
def _left_to_right_marker() -> Any:
    from pydantic import GetPydanticSchema

    return GetPydanticSchema(get_pydantic_core_schema=_left_to_right)


@functools.cache
def _json_array_marker() -> Any:
    from pydantic import BeforeValidator

    return BeforeValidator(_json_array)


Errors = list[Any]  # pydantic's errors (`ErrorDetails`), each with its field path `loc`


def _explained(kind: Any, value: Any, errors: Errors, depth: int, where: str, named: bool) -> ValueError:
    """The first of pydantic's `errors` (all under `value`, `depth` steps into `loc`) as the project says it: in
    field order, a document's missing keys before its fields and its unknown keys after them; `where`: the path so
    far, a nested document named after its class when `named` (an XCom)."""
    arms = typing.get_args(kind)
    if value is not None and typing.get_origin(kind) in (typing.Union, types.UnionType) and len(arms) == 2 \
            and type(None) in arms:  # X | None: X's own error says more
        kind = next(arm for arm in arms if arm is not type(None))
    if isinstance(kind, type) and dataclasses.is_dataclass(kind):
        return _explained_fields(kind, value, errors, depth, f"{where}: {kind.__name__}" if named else where, named)
    here = [error for error in errors if len(error["loc"]) == depth or error["loc"][depth + 1:depth + 2] == ("[key]",)]
    origin = typing.get_origin(kind) or kind
    if here or origin not in (dict, Mapping, list, tuple):
        return _mistyped(kind, value, where)
    step = errors[0]["loc"][depth]
    inner = [error for error in errors if error["loc"][depth] == step]
    args = typing.get_args(kind)
    item = (args[1] if origin in (dict, Mapping) else args[0]) if args else Any
    return _explained(item, value[step], inner, depth + 1,
                      f"{where}.{step}" if origin in (dict, Mapping) else f"{where}[{step}]", named)


def _explained_fields(cls: type, value: Any, errors: Errors, depth: int, where: str, named: bool) -> ValueError:
    own = [error["ctx"]["error"] for error in errors if error["type"] == _OWN_CHECK and len(error["loc"]) == depth]
    if own:
        return own[0]
    if not isinstance(value, Mapping):
        return _refused(where, f"expected a JSON object, got {type(value).__name__}: not a {cls.__name__}")
    fields = [field.name for field in dataclasses.fields(cls) if field.name != getattr(cls, "REST", None)]
    missing = [error["loc"][depth] for error in errors if error["type"] == "missing" and len(error["loc"]) == depth + 1]
    if missing:
        return _refused(where, f"missing key(s) {', '.join(missing)}: not a complete {cls.__name__}")
    hints = typing.get_type_hints(cls)
    for name in fields:
        inner = [error for error in errors if error["loc"][depth:depth + 1] == (name,)]
        if inner:
            return _explained(hints[name], value[name], inner, depth + 1, _at(where, name), named)
    unknown = ", ".join(sorted(str(key) for key in value if key not in fields))
    return _refused(where, f"unknown key(s) {unknown} (a {cls.__name__} has {', '.join(fields)}); it was not "
                           "written by this project's task of this version")


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


def _mistyped(kind: Any, value: Any, where: str) -> DocumentError:
    shown = repr(value)
    shown = shown if len(shown) <= 80 else shown[:77] + "..."
    return _refused(where, f"expected {_name(kind)}, got {type(value).__name__}", f" {shown}")


def _name(kind: Any) -> str:
    """The annotation as its source spells it: `float`, `dict[str, Gate]` (no module paths)."""
    return kind.__name__ if isinstance(kind, type) else re.sub(r"\b(?:[A-Za-z_]\w*\.)+(\w+)", r"\1", str(kind))
