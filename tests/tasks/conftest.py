"""Fixtures shared by the task tests."""

from __future__ import annotations

import http.server
import os
import threading
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


class _Recorder(http.server.BaseHTTPRequestHandler):
    requests: list[str]

    def do_GET(self) -> None:
        self.requests.append(f"GET {self.path}")
        self.send_response(404)
        self.end_headers()

    do_HEAD = do_GET

    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def internal_service():
    """A loopback HTTP service standing for an internal one: its URL and the requests it saw."""
    seen: list[str] = []
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), type("Handler", (_Recorder,), {"requests": seen}))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}", seen
    server.shutdown()
    server.server_close()
