"""Typed XCom documents (core/document.py): plain JSON out, and only what the type says back in."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import pytest

from core.document import Document, DocumentError, OpenDocument, read_fields


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


@dataclass(frozen=True)
class Priced(Document):
    rates: dict[str, float]
    slot: int | str
    sizes: tuple[int | str, ...] = ()
    later: Later | None = None

    def __post_init__(self) -> None:
        if any(rate < 0 for rate in self.rates.values()):
            raise DocumentError("Priced.rates: a rate below 0: refusing the price.")


@pytest.mark.parametrize(("value", "message"), [
    ({"rates": {"a": 1, "b": "2"}, "slot": 1}, "Priced.rates.b: expected float, got str '2'"),
    ({"rates": {}, "slot": True}, "Priced.slot: expected int | str, got bool True"),
    ({"rates": {}, "slot": 1, "sizes": [1, "a", 2.5]}, "Priced.sizes[2]: expected int | str, got float 2.5"),
    ({"rates": {}, "slot": 1, "later": {"size": None}}, "Priced.later: Later.size: expected float, got NoneType"),
    ({"rates": {}, "slot": 1, "later": 3}, "Priced.later: Later: expected a JSON object, got int: not a Later"),
    ({"rate": {}, "slot": "x", "sizes": "y"}, "Priced: missing key(s) rates: not a complete Priced"),
    ({"rates": {}, "slot": "x", "sizes": "y", "b": 1, "a": 2}, "Priced.sizes: expected tuple[int | str, ...]"),
    ({"rates": {}, "slot": "x", "b": 1, "a": 2}, "Priced: unknown key(s) a, b (a Priced has rates, slot, sizes"),
])
def test_the_first_refusal_is_the_one_named_in_field_order_missing_keys_first_and_unknown_keys_last(value, message):
    with pytest.raises(DocumentError) as refused:
        Priced.from_xcom(value)
    assert message in str(refused.value)


@dataclass(frozen=True)
class Order(Document):
    label: str
    priced: Priced


def test_a_union_takes_the_first_arm_that_fits_and_a_document_refuses_by_its_own_check_unchanged():
    priced = Priced.from_xcom({"rates": {"a": 0.5}, "slot": "7", "sizes": [1, "2"]})
    assert (priced.slot, priced.sizes, priced.later) == ("7", (1, "2"), None)
    negative = {"rates": {"a": -1}, "slot": 1}
    with pytest.raises(DocumentError, match=r"^Priced.rates: a rate below 0: refusing the price.$"):
        Priced.from_xcom(negative)
    with pytest.raises(DocumentError, match=r"^Priced.rates: a rate below 0: refusing the price.$"):
        Order.from_json({"label": "a", "priced": negative}, "order.json")
    with pytest.raises(DocumentError, match=r"^Order.label: expected str, got int 3"):  # in field order
        Order.from_xcom({"label": 3, "priced": negative})


def test_read_fields_checks_the_fields_and_hands_back_the_other_keys():
    fields, others = read_fields(Inner, {"name": "x", "size": 2, "seen": [1]})
    assert (fields, others) == ({"name": "x", "size": 2}, {"seen": [1]})
    with pytest.raises(DocumentError, match=r"^size: expected int, got str '2': refusing the document.$"):
        read_fields(Inner, {"name": "x", "size": "2"})
