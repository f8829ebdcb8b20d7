"""Alerts: a message when a task of the run fails, and a warning when the run's throughput collapses.

They go through the Airflow connection `alert_conn_id` to `alert_emails` (settings of the run). The connection
is looked up in prepare, so a missing one or one of the wrong type fails the run before anything is launched.
Sending is best effort: a notifier that cannot send (server down, bad login) is logged and counted
(`gpt_finetune.alert_failed`), and never fails the task or hides its real outcome.
"""

from __future__ import annotations

import html
import logging
import re
import socket
from collections.abc import Callable, Mapping
from typing import Any

from tasks import telemetry
from trainer.config import ConfigError, RunConfig
from trainer.layout import run_key

log = logging.getLogger("gpt_finetune.alerts")

DAG_ID = "gpt_finetune"
REPORTS_PATH = "/gpt-finetune/runs/{run_key}/"  # the UI plugin's run page (plugins/gpt_finetune_ui)
_ERROR_LINE = re.compile(r"\b\w*(Error|Exception)\b: \S")
MAX_REASON_CHARS = 400


def _send_smtp(conn_id: str, recipients: tuple[str, ...], subject: str, text: str) -> None:
    from airflow.providers.smtp.hooks.smtp import SmtpHook

    with SmtpHook(smtp_conn_id=conn_id) as hook:
        hook.send_email_smtp(to=list(recipients), subject=subject, html_content=f"<pre>{html.escape(text)}</pre>",
                             from_email=hook.from_email or f"gpt-finetune@{socket.getfqdn()}")


# Connection type -> sender. Another notifier (Slack, a webhook) is one more entry here.
SENDERS: dict[str, Callable[[str, tuple[str, ...], str, str], None]] = {"smtp": _send_smtp}


def check_alert_connection(cfg: RunConfig) -> None:
    """Refuse, before anything is launched, an alert connection that does not exist or that no sender handles."""
    if not cfg.alert_conn_id:
        return
    from airflow.sdk import BaseHook
    from airflow.sdk.exceptions import AirflowNotFoundException

    try:
        conn = BaseHook.get_connection(cfg.alert_conn_id)
    except AirflowNotFoundException:
        raise ConfigError(
            f"Setting 'alert_conn_id' = {cfg.alert_conn_id!r}: no Airflow connection has this id. Create it (type "
            f"smtp: host, port, login/password, extra from_email) or clear the setting to run without alerts."
        ) from None
    if conn.conn_type not in SENDERS:
        raise ConfigError(
            f"Setting 'alert_conn_id' = {cfg.alert_conn_id!r} is a connection of type {conn.conn_type!r}; alerts are "
            f"sent through connections of type {sorted(SENDERS)}.")


def send_alert(conn_id: str, recipients: tuple[str, ...], subject: str, text: str, *, run: str, task: str) -> bool:
    """Send one alert; True when it went out. Never raises: the run's own outcome is what counts."""
    try:
        from airflow.sdk import BaseHook

        conn_type = BaseHook.get_connection(conn_id).conn_type
        SENDERS[conn_type](conn_id, recipients, subject, text)
    except Exception as error:  # noqa: BLE001 - any notifier failure is logged, never raised
        log.warning("Could not send the alert %r through connection %r (%s: %s); the run's outcome is unchanged.",
                    subject, conn_id, type(error).__name__, error)
        telemetry.count("alert_failed", {"run": run, "task": task})
        return False
    log.info("Alert sent to %s: %s", ", ".join(recipients), subject)
    telemetry.count("alert_sent", {"run": run, "task": task})
    return True


def failure_reason(error: BaseException | str | None) -> str:
    """One line saying why a task failed. For a worker group, the root rank's headline and its own error line
    (the exception the worker printed last), not the launcher's summary line."""
    if error is None:
        return "no exception was recorded (the task process died, or the task was marked failed from outside)"
    result = getattr(error, "result", None)
    failures = getattr(result, "failures", None)
    if failures:
        root = min(failures.values(), key=lambda f: (f.elapsed_s, f.rank))
        errors = [line.strip() for line in root.log_tail if _ERROR_LINE.search(line)]
        reason = root.headline() + (f": {errors[-1]}" if errors else "")
    else:
        lines = [line.strip() for line in str(error).splitlines() if line.strip()]
        reason = f"{type(error).__name__}: {lines[0]}" if lines and not isinstance(error, str) else (
            lines[0] if lines else type(error).__name__)
    return reason if len(reason) <= MAX_REASON_CHARS else reason[:MAX_REASON_CHARS - 3] + "..."


def run_page_url(run_id: str) -> str:
    """The run's page in the Airflow UI's reports plugin (report, charts, samples once evaluate has written them)."""
    from airflow.sdk.configuration import conf

    base = conf.get("api", "base_url", fallback="http://localhost:8080/").rstrip("/")
    return base + REPORTS_PATH.format(run_key=run_key(DAG_ID, run_id))


def _settings(params: Mapping[str, Any] | None) -> tuple[str, tuple[str, ...]]:
    """The alert settings of a run whose other settings may be invalid (a failed prepare must still alert)."""
    params = params or {}
    conn_id = params.get("alert_conn_id") or ""
    emails = params.get("alert_emails") or ()
    if not isinstance(conn_id, str) or not isinstance(emails, (list, tuple)):
        return "", ()
    return conn_id, tuple(address for address in emails if isinstance(address, str) and address)


def alert_task_failure(context: Mapping[str, Any]) -> None:
    """`on_failure_callback` of every task: which task failed, why (one line), where its log and the report are."""
    conn_id, recipients = _settings(context.get("params"))
    ti = context["ti"]
    key = run_key(ti.dag_id, ti.run_id)
    telemetry.count("task_failed", {"run": key, "task": ti.task_id})
    if not conn_id or not recipients:
        return
    reason = failure_reason(context.get("exception"))
    subject = f"[{ti.dag_id}] run {ti.run_id} failed: {ti.task_id}"
    text = "\n".join([
        f"The run {ti.run_id} of {ti.dag_id} failed in task {ti.task_id} (try {ti.try_number}).",
        "",
        f"Reason: {reason}",
        "",
        f"Task log: {ti.log_url}",
        f"Report:   {run_page_url(ti.run_id)}",
    ])
    send_alert(conn_id, recipients, subject, text, run=key, task=ti.task_id)


def alert_run_stopped(params: Mapping[str, Any], run_id: str, reason: str) -> None:
    """The run ended without a failed task (marked failed or skipped from outside): no task alert went out."""
    conn_id, recipients = _settings(params)
    if not conn_id or not recipients:
        return
    text = "\n".join([f"The run {run_id} of {DAG_ID} did not complete.", "", f"Reason: {reason}", "",
                      f"Report: {run_page_url(run_id)}"])
    send_alert(conn_id, recipients, f"[{DAG_ID}] run {run_id} stopped", text, run=run_key(DAG_ID, run_id),
               task="outcome")


def alert_throughput(cfg: RunConfig, run_id: str, warnings: list[str]) -> None:
    """The evaluate task's throughput warnings, as one alert (the report carries them too)."""
    if not cfg.alert_conn_id or not warnings:
        return
    text = "\n".join([f"The run {run_id} of {DAG_ID} trained, but slower than expected:", "",
                      *(f"- {warning}" for warning in warnings), "", f"Report: {run_page_url(run_id)}"])
    send_alert(cfg.alert_conn_id, cfg.alert_emails, f"[{DAG_ID}] run {run_id}: throughput below expectation",
               text, run=run_key(DAG_ID, run_id), task="evaluate")
