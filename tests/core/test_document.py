"""Typed XCom documents (core/document.py): plain JSON out, and only what the type says back in."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import pytest

from core.document import Document, DocumentError, OpenDocument


@dataclass(frozen=True)
class Inner(Document):
    name: str
    size: int


@dataclass(frozen=True)
class Outer(Document):
    label: str
    ratio: float
    flag: bool
    items: tuple[Inner, ...]
    extra: dict[str, Any]
    note: str | None = None


GOOD = {"label": "a", "ratio": 1, "flag": True, "items": [{"name": "x", "size": 2}], "extra": {"k": [1]}}


def test_a_document_survives_json_and_reads_back_typed():
    outer = Outer.from_xcom(json.loads(json.dumps(GOOD)))
    assert outer == Outer("a", 1, True, (Inner("x", 2),), {"k": [1]})
    assert type(outer.ratio) is int and outer.note is None  # a number stays as written: 1 is not rewritten 1.0
    assert json.dumps(outer.to_xcom()) == json.dumps({**GOOD, "note": None})


@pytest.mark.parametrize(("value", "message"), [
    ([GOOD], "Outer: expected a JSON object, got list"),
    ({**GOOD, "labels": "b"}, "Outer: unknown key(s) labels"),
    ({k: v for k, v in GOOD.items() if k != "flag"}, "Outer: missing key(s) flag"),
    ({**GOOD, "label": 3}, "Outer.label: expected str, got int 3"),
    ({**GOOD, "ratio": True}, "Outer.ratio: expected float, got bool True"),
    ({**GOOD, "flag": "yes"}, "Outer.flag: expected bool, got str 'yes'"),
    ({**GOOD, "items": [{"name": "x", "size": "2"}]}, "Outer.items[0]: Inner.size: expected int, got str '2'"),
    ({**GOOD, "items": [{"name": "x", "size": 2, "path": "/etc"}]},
     "Outer.items[0]: Inner: unknown key(s) path (a Inner has name, size)"),
    ({**GOOD, "extra": {1: 2}}, "Outer.extra: expected"),
    ({**GOOD, "note": ["a"]}, "Outer.note: expected"),
    ({**GOOD, "ratio": 10 ** 400}, "Outer.ratio: expected float, got int"),
])
def test_anything_else_is_refused_naming_the_field(value, message):
    with pytest.raises(DocumentError) as refused:
        Outer.from_xcom(value)
    assert message in str(refused.value)


@dataclass(frozen=True)
class Later(OpenDocument):
    size: float
    parts: tuple[Inner, ...] = ()

    DERIVED = frozenset({"total"})


def test_an_open_document_keeps_the_keys_it_does_not_model_and_writes_them_back():
    written = {"size": 3, "parts": [{"name": "x", "size": 2}], "carbon": {"kg": 0.1}, "total": 9, "loss": 2.5}
    later = Later.from_json(written, "s3://bucket/report.json")
    assert later.extra == {"carbon": {"kg": 0.1}, "loss": 2.5} and type(later.size) is int  # `total`: derived
    assert json.dumps(later.to_xcom()) == json.dumps({k: v for k, v in written.items() if k != "total"})
    assert Later.from_xcom({"size": float("nan")}).size != Later.from_xcom({"size": float("nan")}).size  # NaN kept


@pytest.mark.parametrize(("value", "path", "problem"), [
    ([1], "", "expected a JSON object, got list: not a Later"),
    ({}, "", "missing key(s) size: not a complete Later"),
    ({"size": "3"}, "size", "expected float, got str"),
    ({"size": 3, "parts": [{"name": "x", "size": 2, "path": "/"}]}, "parts[0]",
     "unknown key(s) path (a Inner has name, size)"),
    ({"size": 3, "parts": [{"name": "x", "size": 2.5}]}, "parts[0].size", "expected int, got float"),
])
def test_reading_a_file_names_the_file_and_the_field_path(value, path, problem):
    with pytest.raises(DocumentError) as refused:
        Later.from_json(value, "s3://bucket/report.json")
    error = refused.value
    assert (error.source, error.path) == ("s3://bucket/report.json", path) and error.problem.startswith(problem)
    assert str(error).startswith(": ".join(part for part in ("s3://bucket/report.json", path, problem) if part))
    assert error.brief == ": ".join(part for part in (path, error.problem) if part)  # no file, no value
