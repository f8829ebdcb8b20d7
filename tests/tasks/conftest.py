"""Fixtures shared by the task tests."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tasks import evaluate
from tests.support.metrics_sinks import StatsdListener

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def evaluations(tmp_path, monkeypatch):
    """Route evaluation to the fixture entry point; returns a function listing the models it evaluated."""
    calls = tmp_path / "evaluate-calls.txt"
    calls.touch()
    monkeypatch.setattr(evaluate, "EVALUATE_MODULE", "tests.tasks.fixture_evaluate")
    monkeypatch.setenv("TFMW_FIXTURE_EVALUATE_CALLS", str(calls))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    return lambda: calls.read_text().split()


@pytest.fixture
def statsd(monkeypatch):
    """Airflow's metrics on, StatsD InfluxDB-style tags, sent to a listener of the test."""
    from airflow.sdk.observability import stats
    from airflow.sdk.observability.metrics import stats_utils

    listener = StatsdListener()
    for option, value in {"STATSD_ON": "True", "STATSD_HOST": "127.0.0.1", "STATSD_PORT": str(listener.port),
                          "STATSD_PREFIX": "airflow", "STATSD_INFLUXDB_ENABLED": "True"}.items():
        monkeypatch.setenv(f"AIRFLOW__METRICS__{option}", value)
    stats.initialize(factory=stats_utils.get_stats_factory(), export_legacy_names=False)
    try:
        yield listener
    finally:
        monkeypatch.undo()
        stats.initialize(factory=stats_utils.get_stats_factory(), export_legacy_names=False)
        listener.stop()
