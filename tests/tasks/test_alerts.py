"""tasks.alerts against a real SMTP server (aiosmtpd on loopback), with connections from the environment; servers
that never answer or stall mid-send (real sockets on loopback), and a real StatsD listener for the counters."""

from __future__ import annotations

import inspect
import logging
import threading
import time
from types import SimpleNamespace

import pytest

from core.config import ConfigError, RunConfig
from core.layout import run_key
from launcher.errors import WorkerFailedError
from launcher.spec import FailureKind, GroupState, RunResult, WorkerFailure
from tasks import alerts
from tests.support.metrics_sinks import SmtpSink, StallingSmtpServer, StatsdListener

RUN_ID = "manual__2026-12-03T10:00:00+00:00"


ALLOW_LISTS = {"GPT_FINETUNE_ALERT_CONN_IDS": "alerts_smtp,alerts_silent", "GPT_FINETUNE_ALERT_DOMAINS": "example.com"}


@pytest.fixture(autouse=True)
def allow_lists(monkeypatch):
    """The deployment's alert allow-lists (core/config/access.py), which the failure callback applies too."""
    for name, value in ALLOW_LISTS.items():
        monkeypatch.setenv(name, value)


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
    cfg = RunConfig.of(alert_conn_id="alerts_smtp", alert_emails=("ops@example.com",))
    alerts.alert_throughput(cfg, RUN_ID, ["1,000 tokens/s is 20% of the 5,000 the preflight advisor predicted"])
    stopped, slow = smtp.messages
    assert stopped["Subject"] == f"[gpt_finetune] run {RUN_ID} stopped"
    assert "Reason: The run stopped before 'promote' succeeded" in smtp.text(stopped)
    assert slow["Subject"] == f"[gpt_finetune] run {RUN_ID}: throughput below expectation"
    assert "- 1,000 tokens/s is 20% of the 5,000" in smtp.text(slow)


def test_the_alert_connection_is_checked_before_launch(smtp):
    alerts.check_alert_connection(RunConfig.of(alert_conn_id="alerts_smtp", alert_emails=("ops@example.com",)))
    alerts.check_alert_connection(RunConfig())  # no alerts: nothing to look up
    with pytest.raises(ConfigError, match="'alert_conn_id' = 'missing': no Airflow connection has this id"):
        alerts.check_alert_connection(RunConfig.of(alert_conn_id="missing", alert_emails=("ops@example.com",)))
    with pytest.raises(ConfigError, match=r"is a connection of type 'aws'; alerts are sent through connections "
                                          r"of type \['smtp'\]"):
        alerts.check_alert_connection(RunConfig.of(alert_conn_id="storage_s3", alert_emails=("ops@example.com",)))


# -- bounded in time, checked in the callback (issue 37: review findings 5 and 7) ---------------------------------

@pytest.fixture
def stalling(request, monkeypatch):
    server = StallingSmtpServer(stall_at=getattr(request, "param", None))
    monkeypatch.setenv("AIRFLOW_CONN_ALERTS_SILENT", server.connection_uri())  # the provider's 30 s, 5 retries
    try:
        yield server
    finally:
        server.stop()


def counted(listener: StatsdListener, name: str, **tags: str) -> list:
    deadline = time.monotonic() + 5
    while not listener.matching(name, **tags) and time.monotonic() < deadline:
        time.sleep(0.02)
    return listener.matching(name, **tags)


def timed_callback(context_: dict, limit_s: float) -> float:
    """Run the failure callback as Airflow's finalize() does, in a thread so that today's unbounded send fails the
    test instead of hanging it; its duration."""
    errors: list[BaseException] = []

    def callback() -> None:
        try:
            alerts.alert_task_failure(context_)
        except BaseException as error:  # noqa: BLE001 - the assertion below names it
            errors.append(error)

    started = time.monotonic()
    thread = threading.Thread(target=callback, daemon=True)
    thread.start()
    thread.join(limit_s)
    elapsed = time.monotonic() - started
    assert not thread.is_alive(), f"the failure callback was still sending after {limit_s} s"
    assert errors == [], "the callback raised: the task's outcome must not depend on the alert"
    return elapsed


def test_the_deadline_fits_the_task_runners_kill_window():
    """Airflow SIGTERMs the task process `task_success_overtime` after the failed state and SIGKILLs it after the
    escalation delay (see tasks/alerts.py): an alert's deadline, and every socket wait, must end well before."""
    from airflow.sdk.configuration import conf
    from airflow.sdk.execution_time.supervisor import ActivitySubprocess

    escalation_s = inspect.signature(ActivitySubprocess.kill).parameters["escalation_delay"].default
    window_s = conf.getfloat("core", "task_success_overtime") + escalation_s
    assert window_s == 25.0  # 20 s + 5 s: the window the module's comment names
    assert alerts.SMTP_TIMEOUT_S < alerts.ALERT_DEADLINE_S <= window_s / 2


def test_the_smtp_hook_waits_at_most_the_alert_timeout_and_never_retries(stalling):
    from airflow.sdk import BaseHook

    hook = alerts._smtp_hook_class()(smtp_conn_id="alerts_silent")
    hook.smtp_connection = BaseHook.get_connection("alerts_silent")  # extra without timeout: the provider's 30 s
    assert (hook.timeout, hook.smtp_retry_limit) == (alerts.SMTP_TIMEOUT_S, 0)


def test_a_server_that_never_answers_gives_up_within_the_timeout_and_counts_alert_failed(
        stalling, statsd, monkeypatch, caplog):
    monkeypatch.setattr(alerts, "SMTP_TIMEOUT_S", 1.0)  # the same bound as the default 5 s, in a second
    with caplog.at_level(logging.WARNING, logger="gpt_finetune.alerts"):
        elapsed = timed_callback(context(RuntimeError("boom"), alert_conn_id="alerts_silent"), limit_s=8)

    assert 0.9 <= elapsed < 2.5 and stalling.connections == 1  # one greeting wait, no retry
    assert "Could not send the alert" in caplog.text and "Unable to connect to smtp server" in caplog.text
    key = run_key("gpt_finetune", RUN_ID)
    assert counted(statsd, "gpt_finetune.alert_failed", run=key, task="train")
    assert counted(statsd, "gpt_finetune.task_failed", run=key, task="train")
    assert not statsd.matching("gpt_finetune.alert_sent")


@pytest.mark.parametrize("stalling", ["RCPT"], indirect=True)
def test_a_server_that_stalls_mid_send_is_abandoned_at_the_deadline(stalling, statsd, monkeypatch, caplog):
    """Each socket wait within its timeout, the whole send past the deadline: abandoned, its socket shut down."""
    monkeypatch.setattr(alerts, "ALERT_DEADLINE_S", 1.0)
    monkeypatch.setattr(alerts, "SMTP_TIMEOUT_S", 30.0)
    with caplog.at_level(logging.WARNING, logger="gpt_finetune.alerts"):
        elapsed = timed_callback(context(RuntimeError("boom"), alert_conn_id="alerts_silent"), limit_s=8)

    assert 0.9 <= elapsed < 2.0
    assert "AlertTimeout: no answer within 1 s" in caplog.text
    assert counted(statsd, "gpt_finetune.alert_failed", run=run_key("gpt_finetune", RUN_ID), task="train")
    deadline = time.monotonic() + 2  # the abandoned send's thread was woken by the shutdown, not left waiting 30 s
    while any(t.name == "gpt-finetune-alert" for t in threading.enumerate()) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not any(t.name == "gpt-finetune-alert" for t in threading.enumerate())


def test_the_throughput_alert_in_evaluate_is_bounded_too(stalling, monkeypatch):
    """evaluate holds GPU slots while it sends: the same deadline applies."""
    monkeypatch.setattr(alerts, "ALERT_DEADLINE_S", 1.0)
    started = time.monotonic()
    alerts.alert_throughput(RunConfig.of(alert_conn_id="alerts_silent", alert_emails=("ops@example.com",)), RUN_ID,
                            ["1,000 tokens/s is 20% of the 5,000 the preflight advisor predicted"])
    assert time.monotonic() - started < 2.0


INJECTED = "ops@example.com\r\n\r\nYour key leaked - rotate it at https://evil.example/rotate"


def test_a_crlf_recipient_is_refused_in_the_callback_and_never_reaches_the_header(smtp, statsd, caplog):
    """The review's reproduction (finding 7): prepare refuses this address; the callback read it raw and sent it."""
    with caplog.at_level(logging.WARNING, logger="gpt_finetune.alerts"):
        alerts.alert_task_failure(context(RuntimeError("boom"), alert_emails=[INJECTED, "ml@example.com"]))

    (message,) = smtp.messages
    assert message["To"] == "ml@example.com"
    assert "evil.example" not in message.as_string()
    assert "is not an e-mail address" in caplog.text
    assert "\\r\\n" in caplog.text and "\r\nYour key" not in caplog.text  # logged escaped, on one line
    assert counted(statsd, "gpt_finetune.alert_failed", run=run_key("gpt_finetune", RUN_ID), task="train")


def test_the_callback_refuses_the_reviews_comment_address_under_a_wildcard_domain(smtp, caplog, monkeypatch):
    """Review t5, finding 3: with `*.example.org` allowed, `a@evil.com(.example.org` passed the callback's check and
    smtplib sent it to evil.com."""
    monkeypatch.setenv("GPT_FINETUNE_ALERT_DOMAINS", "*.example.org")
    with caplog.at_level(logging.WARNING, logger="gpt_finetune.alerts"):
        alerts.alert_task_failure(context(RuntimeError("boom"), alert_emails=["a@evil.com(.example.org",
                                                                                "ml@team.example.org"]))
    (message,) = smtp.messages
    assert message["To"] == "ml@team.example.org" and "evil.com" not in message.as_string()
    assert "'a@evil.com(.example.org', which is not an e-mail address of the plain form" in caplog.text


@pytest.mark.parametrize("params, why", [
    ({"alert_emails": [INJECTED]}, "is not an e-mail address"),
    ({"alert_emails": ["ops@elsewhere.example.net"]}, "outside the recipient domains"),
    ({"alert_conn_id": "alerts_smtp\nX-Forged: 1"}, "is not a connection id"),
    ({"alert_conn_id": "storage_s3"}, "outside the alert connections"),
    ({"alert_emails": "ops@example.com"}, "of types str / str"),
])
def test_refused_alert_settings_send_nothing_and_say_why(smtp, caplog, params, why):
    with caplog.at_level(logging.WARNING, logger="gpt_finetune.alerts"):
        alerts.alert_task_failure(context(RuntimeError("boom"), **params))
        alerts.alert_run_stopped({"alert_conn_id": "alerts_smtp", "alert_emails": ["ops@example.com"], **params},
                                 RUN_ID, "stopped")
    assert smtp.messages == []
    assert "Alert settings refused" in caplog.text and why in caplog.text


def test_a_run_id_with_a_newline_makes_a_one_line_subject(smtp):
    cfg = RunConfig.of(alert_conn_id="alerts_smtp", alert_emails=("ops@example.com",))
    alerts.alert_throughput(cfg, "manual__1\n", ["slow"])
    (message,) = smtp.messages
    assert message["Subject"] == "[gpt_finetune] run manual__1\\n: throughput below expectation"
