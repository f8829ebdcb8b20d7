"""The failure alert through Airflow's real task runner (`dag.test()` in a subprocess) against an SMTP server that
never answers (a real socket on loopback that accepts and stays silent): the alert gives up within its timeout,
is counted as `alert_failed`, and the task's outcome is unchanged (issue 37 item 3, review finding 5)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

from tasks import alerts
from tests.support.metrics_sinks import StallingSmtpServer, StatsdListener

HARNESS = Path(__file__).resolve().parent / "alert_dags" / "alert_harness.py"
REPO = Path(__file__).resolve().parents[2]


def test_a_silent_smtp_server_leaves_the_task_failed_and_the_alert_counted_as_failed(airflow_env, tmp_path):
    server, statsd = StallingSmtpServer(), StatsdListener()
    env = {**airflow_env, "AIRFLOW__CORE__DAGS_FOLDER": str(HARNESS.parent),
           "AIRFLOW_CONN_ALERTS_SILENT": server.connection_uri(),  # the provider's 30 s timeout and 5 retries
           "GPT_FINETUNE_ALERT_CONN_IDS": "alerts_silent", "GPT_FINETUNE_ALERT_DOMAINS": "example.com",
           "AIRFLOW__METRICS__STATSD_ON": "True", "AIRFLOW__METRICS__STATSD_HOST": "127.0.0.1",
           "AIRFLOW__METRICS__STATSD_PORT": str(statsd.port), "AIRFLOW__METRICS__STATSD_PREFIX": "airflow",
           "AIRFLOW__METRICS__STATSD_INFLUXDB_ENABLED": "True"}
    out = tmp_path / "out.json"
    try:
        done = subprocess.run([sys.executable, str(HARNESS), str(out)], env=env, cwd=REPO, capture_output=True,
                              text=True, timeout=240, check=False)
        log = done.stdout + done.stderr
        result = json.loads(out.read_text())
        assert result["task_states"] == {"fails": "failed"}, log[-3000:]  # the task's own outcome, unchanged
        assert "ValueError: the task's own failure" in log
        gave_up = re.search(r"Could not send the alert .* after (\d+\.\d) s", log)
        assert gave_up, log[-3000:]
        assert float(gave_up.group(1)) <= alerts.SMTP_TIMEOUT_S + 1.0 and server.connections == 1
        assert statsd.matching("gpt_finetune.alert_failed", task="fails") or _wait(statsd)
    finally:
        server.stop()
        statsd.stop()


def _wait(statsd: StatsdListener) -> bool:
    import time

    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        if statsd.matching("gpt_finetune.alert_failed", task="fails"):
            return True
        time.sleep(0.05)
    return False
