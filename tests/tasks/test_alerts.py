"""tasks.alerts against a real SMTP server (aiosmtpd on loopback), with connections from the environment."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest

from launcher.errors import WorkerFailedError
from launcher.spec import FailureKind, GroupState, RunResult, WorkerFailure
from tasks import alerts
from tests.support.metrics_sinks import SmtpSink
from trainer.config import ConfigError, RunConfig
from trainer.layout import run_key

RUN_ID = "manual__2026-12-03T10:00:00+00:00"


@pytest.fixture
def smtp(monkeypatch):
    sink = SmtpSink()
    monkeypatch.setenv("AIRFLOW_CONN_ALERTS_SMTP", sink.connection_uri())
    monkeypatch.setenv("AIRFLOW_CONN_STORAGE_S3", "aws://key:secret@")
    monkeypatch.setenv("AIRFLOW__API__BASE_URL", "http://airflow.example:8080/")
    try:
        yield sink
    finally:
        sink.stop()


def context(error, **params):
    ti = SimpleNamespace(dag_id="gpt_finetune", run_id=RUN_ID, task_id="train", try_number=2,
                         log_url="http://airflow.example:8080/dags/gpt_finetune/runs/x/tasks/train?try_number=2")
    return {"ti": ti, "exception": error, "params": {"alert_conn_id": "alerts_smtp",
                                                     "alert_emails": ["ops@example.com", "ml@example.com"], **params}}


def worker_group_error() -> WorkerFailedError:
    tail = ("step 1/40 loss 5.7604 lr 1.00e+00 tokens/s 41 ETA 0:01:32", "Traceback (most recent call last):",
            ("trainer.metrics.LossDivergedError: rank 0: the training loss diverged at step 2: 31.6472 is 25.89 "
             "nats above its lowest so far (5.7604 at step 1; the limit 'max_loss_rise' is 3): lower 'learning_rate'"))
    failure = WorkerFailure(rank=0, host="gpu-a", pid=4242, kind=FailureKind.EXIT_CODE, exit_code=1, elapsed_s=9.5,
                            detail="exited with code 1", log_tail=tail)
    result = RunResult(name="train", state=GroupState.FAILED, workers=(), failures={0: failure}, attempts=1,
                       wall_time_s=10.0, log_files={0: "/tmp/rank-0.log"})
    return WorkerFailedError(result)


def test_a_failed_task_mails_task_reason_log_and_report_link(smtp):
    alerts.alert_task_failure(context(worker_group_error()))

    (message,) = smtp.messages
    assert message["Subject"] == f"[gpt_finetune] run {RUN_ID} failed: train"
    assert message["To"] == "ops@example.com, ml@example.com" and message["From"] == "airflow@example.com"
    text = smtp.text(message)
    assert "failed in task train (try 2)" in text
    assert ("Reason: rank 0 (host gpu-a, pid 4242) exited with code 1: trainer.metrics.LossDivergedError: rank 0: "
            "the training loss diverged at step 2") in text
    assert "Task log: http://airflow.example:8080/dags/gpt_finetune/runs/x/tasks/train?try_number=2" in text
    assert f"Report:   http://airflow.example:8080/gpt-finetune/runs/{run_key('gpt_finetune', RUN_ID)}/" in text


def test_no_alert_settings_no_mail(smtp):
    alerts.alert_task_failure(context(RuntimeError("boom"), alert_conn_id="", alert_emails=[]))
    assert smtp.messages == []


def test_a_server_that_is_down_is_logged_and_never_raises(smtp, caplog):
    smtp.stop()
    with caplog.at_level(logging.WARNING, logger="gpt_finetune.alerts"):
        alerts.alert_task_failure(context(RuntimeError("boom")))
    assert "Could not send the alert" in caplog.text and "the run's outcome is unchanged" in caplog.text


@pytest.mark.parametrize("error, reason", [
    (ValueError("bad value\nmore detail"), "ValueError: bad value"),
    (None, "no exception was recorded (the task process died, or the task was marked failed from outside)"),
    ("Task exited with return code -9", "Task exited with return code -9"),
    (RuntimeError("x" * 1000), "RuntimeError: " + "x" * 383 + "..."),
])
def test_failure_reason_is_one_line(error, reason):
    assert alerts.failure_reason(error) == reason


def test_a_stopped_run_and_throughput_warnings_are_mailed(smtp):
    alerts.alert_run_stopped({"alert_conn_id": "alerts_smtp", "alert_emails": ["ops@example.com"]}, RUN_ID,
                             "The run stopped before 'promote' succeeded")
    cfg = RunConfig(alert_conn_id="alerts_smtp", alert_emails=("ops@example.com",))
    alerts.alert_throughput(cfg, RUN_ID, ["1,000 tokens/s is 20% of the 5,000 the preflight advisor predicted"])
    stopped, slow = smtp.messages
    assert stopped["Subject"] == f"[gpt_finetune] run {RUN_ID} stopped"
    assert "Reason: The run stopped before 'promote' succeeded" in smtp.text(stopped)
    assert slow["Subject"] == f"[gpt_finetune] run {RUN_ID}: throughput below expectation"
    assert "- 1,000 tokens/s is 20% of the 5,000" in smtp.text(slow)


def test_the_alert_connection_is_checked_before_launch(smtp):
    alerts.check_alert_connection(RunConfig(alert_conn_id="alerts_smtp", alert_emails=("ops@example.com",)))
    alerts.check_alert_connection(RunConfig())  # no alerts: nothing to look up
    with pytest.raises(ConfigError, match="'alert_conn_id' = 'missing': no Airflow connection has this id"):
        alerts.check_alert_connection(RunConfig(alert_conn_id="missing", alert_emails=("ops@example.com",)))
    with pytest.raises(ConfigError, match=r"is a connection of type 'aws'; alerts are sent through connections "
                                          r"of type \['smtp'\]"):
        alerts.check_alert_connection(RunConfig(alert_conn_id="storage_s3", alert_emails=("ops@example.com",)))
