"""Typed XCom documents (launcher/document.py): plain JSON out, and only what the type says back in."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import pytest

from launcher.document import Document, DocumentError


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
    assert outer == Outer("a", 1.0, True, (Inner("x", 2),), {"k": [1]})
    assert isinstance(outer.ratio, float) and outer.note is None
    assert json.loads(json.dumps(outer.to_xcom())) == {**GOOD, "ratio": 1.0, "note": None}


@pytest.mark.parametrize(("value", "message"), [
    ([GOOD], "Outer: expected a JSON object, got list"),
    ({**GOOD, "labels": "b"}, "Outer: unknown key(s) labels"),
    ({k: v for k, v in GOOD.items() if k != "flag"}, "Outer: missing key(s) flag"),
    ({**GOOD, "label": 3}, "Outer.label: expected str, got int 3"),
    ({**GOOD, "ratio": True}, "Outer.ratio: expected float, got bool True"),
    ({**GOOD, "flag": "yes"}, "Outer.flag: expected bool, got str 'yes'"),
    ({**GOOD, "items": [{"name": "x", "size": "2"}]}, "Outer.items[0]: Inner.size: expected int, got str '2'"),
    ({**GOOD, "items": [{"name": "x", "size": 2, "path": "/etc"}]}, "Inner: unknown key(s) path"),
    ({**GOOD, "extra": {1: 2}}, "Outer.extra: expected"),
    ({**GOOD, "note": ["a"]}, "Outer.note: expected"),
])
def test_anything_else_is_refused_naming_the_field(value, message):
    with pytest.raises(DocumentError) as refused:
        Outer.from_xcom(value)
    assert message in str(refused.value)
