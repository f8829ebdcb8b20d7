"""Fixtures shared by the task tests."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tasks import compare

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def evaluations(tmp_path, monkeypatch):
    """Route evaluation to the fixture entry point; returns a function listing the models it evaluated."""
    calls = tmp_path / "evaluate-calls.txt"
    calls.touch()
    monkeypatch.setattr(compare, "EVALUATE_MODULE", "tests.tasks.fixture_evaluate")
    monkeypatch.setenv("TFMW_FIXTURE_EVALUATE_CALLS", str(calls))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    return lambda: calls.read_text().split()
