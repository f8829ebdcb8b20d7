"""Alerts: a message when a task of the run fails, and a warning when the run's throughput collapses.

They go through the Airflow connection `alert_conn_id` to `alert_emails` (settings of the run). The connection
is looked up in prepare, so a missing one or one of the wrong type fails the run before anything is launched.
Sending is best effort: a notifier that cannot send (server down, bad login) is logged and counted
(`gpt_finetune.alert_failed`), and never fails the task or hides its real outcome.

Sending is bounded in time. A failure callback runs after the task runner reported the failed state, and Airflow
kills the task process a fixed time after that (see `ALERT_DEADLINE_S`): an alert must go out, or be logged and
counted as failed, well before then. The failure callback's settings come from raw params (a failed prepare must
still alert), so the recipients and the connection id are checked again here: a control character (a CR/LF header
injection) or a value outside the access policy's allow-lists is refused, logged and counted, never sent.
"""

from __future__ import annotations

import functools
import html
import logging
import re
import socket
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from core.config import ConfigError, RunConfig, schema
from core.config.access import AccessPolicy
from core.config.core import is_email_address
from core.layout import run_key
from tasks import telemetry

log = logging.getLogger("gpt_finetune.alerts")

DAG_ID = "gpt_finetune"
REPORTS_PATH = "/gpt-finetune/runs/{run_key}/"  # the UI plugin's run page (plugins/gpt_finetune_ui)
_ERROR_LINE = re.compile(r"\b\w*(Error|Exception)\b: \S")
MAX_REASON_CHARS = 400
# The time one alert may take, connection lookup included; past it the send is abandoned (its socket shut down),
# logged and counted as `alert_failed`. Airflow's kill window for a callback, verified in the installed task SDK
# (apache-airflow-task-sdk 1.3.2, airflow/sdk/execution_time/):
# - task_runner.py:1718 sends the terminal TaskState(FAILED) (end of run()) before main() runs finalize() and the
#   on_failure_callback in it (task_runner.py:2442-2444, :2364);
# - supervisor.py:1790-1794 starts the overtime clock on that message; supervisor.py:1682-1697 then sends SIGTERM
#   once `[core] task_success_overtime` has passed (read at supervisor.py:190; default 20 s,
#   airflow/config_templates/config.yml:379-386);
# - task_runner.py:1544-1551 turns SIGTERM into on_kill() only, so SIGKILL follows after the escalation delay of
#   supervisor.py:1079 (5 s): about 25 s in all, less the monitor loop's polling.
# 10 s leaves the callback's other work (the connection and conf lookups, logging) more than 10 s of margin.
ALERT_DEADLINE_S = 10.0
# Each SMTP socket operation (connect, greeting, every command) waits at most this long; a connection's own
# `timeout` extra may lower it, never raise it (SmtpHook's default is 30 s).
SMTP_TIMEOUT_S = 5.0
SMTP_RETRY_LIMIT = 0  # SmtpHook's default 5 retries re-send over the same broken connection: none within a deadline
# The formats RunConfig checks (core/config/schema.py), applied here one value at a time.
_CONN_ID = re.compile(schema.CONN_ID)


class AlertTimeout(TimeoutError):
    """An alert took longer than `ALERT_DEADLINE_S`: given up, so that the callback ends before Airflow kills it."""


@functools.cache
def _smtp_hook_class() -> type:
    """SmtpHook with the socket timeout and retries bounded (imported when first needed: the DAG file stays thin)."""
    from airflow.providers.smtp.hooks.smtp import SmtpHook

    class BoundedSmtpHook(SmtpHook):
        @property
        def timeout(self) -> float:  # type: ignore[override]
            configured = float(super().timeout)
            return min(configured, SMTP_TIMEOUT_S) if configured > 0 else SMTP_TIMEOUT_S

        @property
        def smtp_retry_limit(self) -> int:
            return max(0, min(super().smtp_retry_limit, SMTP_RETRY_LIMIT))

        def _build_client_kwargs(self, is_async: bool) -> dict[str, Any]:
            # smtplib's EHLO name is socket.getfqdn() otherwise: a slow resolver must not eat the deadline
            return {**super()._build_client_kwargs(is_async), **({} if is_async else {
                "local_hostname": socket.gethostname()})}

    return BoundedSmtpHook


def _shut(hook: Any) -> None:
    """Wake a send blocked on the hook's socket (called from the waiting thread when the deadline passed)."""
    sock = getattr(getattr(hook, "_smtp_client", None), "sock", None)  # the connected smtplib client's socket
    if sock is not None:
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass


def _send_smtp(conn_id: str, recipients: tuple[str, ...], subject: str, text: str,
               on_abort: list[Callable[[], None]]) -> None:
    hook = _smtp_hook_class()(smtp_conn_id=conn_id)
    on_abort.append(lambda: _shut(hook))
    with hook:
        hook.send_email_smtp(to=list(recipients), subject=subject, html_content=f"<pre>{html.escape(text)}</pre>",
                             from_email=hook.from_email or f"gpt-finetune@{socket.gethostname()}")


# Connection type -> sender(conn_id, recipients, subject, text, on_abort): a sender appends to `on_abort` what
# unblocks it when the deadline passes. Another notifier (Slack, a webhook) is one more entry here.
SENDERS: dict[str, Callable[[str, tuple[str, ...], str, str, list[Callable[[], None]]], None]] = {
    "smtp": _send_smtp}


def check_alert_connection(cfg: RunConfig) -> None:
    """Refuse, before anything is launched, an alert connection that does not exist or that no sender handles."""
    conn_id = cfg.monitoring.alert_conn_id
    if not conn_id:
        return
    from airflow.sdk import BaseHook
    from airflow.sdk.exceptions import AirflowNotFoundException

    try:
        conn = BaseHook.get_connection(conn_id)
    except AirflowNotFoundException:
        raise ConfigError(
            f"Setting 'alert_conn_id' = {conn_id!r}: no Airflow connection has this id. Create it (type "
            f"smtp: host, port, login/password, extra from_email) or clear the setting to run without alerts."
        ) from None
    if conn.conn_type not in SENDERS:
        raise ConfigError(
            f"Setting 'alert_conn_id' = {conn_id!r} is a connection of type {conn.conn_type!r}; alerts are "
            f"sent through connections of type {sorted(SENDERS)}.")


def _send(conn_id: str, recipients: tuple[str, ...], subject: str, text: str,
          on_abort: list[Callable[[], None]]) -> None:
    from airflow.sdk import BaseHook

    conn_type = BaseHook.get_connection(conn_id).conn_type
    SENDERS[conn_type](conn_id, recipients, subject, text, on_abort)


def _send_within(deadline_s: float, *args: Any) -> None:
    """`_send(*args)` in a daemon thread, waited for at most `deadline_s`: AlertTimeout after that (the sender's
    socket is shut down, and a thread still stuck in a connect ends with the process). Its error is re-raised."""
    outcome: list[BaseException | None] = []
    on_abort: list[Callable[[], None]] = []

    def attempt() -> None:
        try:
            _send(*args, on_abort)
            outcome.append(None)
        except BaseException as error:  # noqa: BLE001 - handed to the waiting thread
            outcome.append(error)

    worker = threading.Thread(target=attempt, name="gpt-finetune-alert", daemon=True)
    worker.start()
    worker.join(deadline_s)
    if worker.is_alive():
        for abort in on_abort:
            abort()
        raise AlertTimeout(f"no answer within {deadline_s:g} s (tasks.alerts.ALERT_DEADLINE_S); abandoned")
    if outcome and outcome[0] is not None:
        raise outcome[0]


def send_alert(conn_id: str, recipients: tuple[str, ...], subject: str, text: str, *, run: str, task: str) -> bool:
    """Send one alert within `ALERT_DEADLINE_S`; True when it went out. Never raises: the run's own outcome is what
    counts."""
    started = time.monotonic()
    subject = printable(subject)
    try:
        _send_within(ALERT_DEADLINE_S, conn_id, recipients, subject, text)
    except Exception as error:  # noqa: BLE001 - any notifier failure is logged, never raised
        log.warning("Could not send the alert %r through connection %r after %.1f s (%s: %s); the run's outcome is "
                    "unchanged.", subject, conn_id, time.monotonic() - started, type(error).__name__, error)
        telemetry.count("alert_failed", {"run": run, "task": task})
        return False
    log.info("Alert sent to %s: %r", ", ".join(map(repr, recipients)), subject)
    telemetry.count("alert_sent", {"run": run, "task": task})
    return True


def printable(text: str) -> str:
    """`text` on one line: control characters (CR, LF, ...) shown as escapes, never passed into a header."""
    return "".join(ch if ch.isprintable() else ascii(ch)[1:-1] for ch in text)


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


def _settings(params: Mapping[str, Any] | None) -> tuple[str, tuple[str, ...], list[str]]:
    """The alert settings of a run whose other settings may be invalid (a failed prepare must still alert), checked
    as prepare checks them: (connection id, recipients, why values were refused). A connection id that is not one,
    or outside the allow-list, sends nothing; a recipient that is not an address, or outside the allowed domains,
    is left out. Read value by value (RunConfig would refuse all of a run for one bad setting), with RunConfig's
    formats (`schema`) and allow-lists."""
    params = params or {}
    conn_id = params.get("alert_conn_id") or ""
    emails = params.get("alert_emails") or ()
    if not isinstance(conn_id, str) or not isinstance(emails, (list, tuple)):
        return "", (), [f"alert_conn_id / alert_emails of types {type(conn_id).__name__} / {type(emails).__name__}"]
    if not conn_id:
        return "", (), []
    policy = AccessPolicy.from_env()
    if not _CONN_ID.fullmatch(conn_id):
        return "", (), [f"Setting 'alert_conn_id' = {conn_id!r} is not a connection id"]
    refused = _refusal(policy, "alert_conn_id", conn_id)
    if refused:
        return "", (), refused
    recipients = []
    for address in emails:
        why = _refusal(policy, "alert_emails", address) if is_email_address(address) else [
            (f"Setting 'alert_emails' has {address!r}, which is not an e-mail address of the plain form "
             "name@domain.tld")]
        refused += why
        recipients += [] if why else [address]
    return conn_id, tuple(recipients), refused


def _refusal(policy: AccessPolicy, name: str, value: str) -> list[str]:
    try:
        policy.check_allowed(name, value)
    except ConfigError as error:
        return [str(error)]
    return []


def _usable_settings(params: Mapping[str, Any] | None, *, run: str, task: str) -> tuple[str, tuple[str, ...]]:
    """`_settings`, with each refusal logged (the values escaped) and one `alert_failed` counted when any was."""
    conn_id, recipients, refused = _settings(params)
    for reason in refused:
        log.warning("Alert settings refused (the alert is not sent %s): %s",
                    "to this recipient" if conn_id else "at all", printable(reason))
    if refused:
        telemetry.count("alert_failed", {"run": run, "task": task})
    return conn_id, recipients


def alert_task_failure(context: Mapping[str, Any]) -> None:
    """`on_failure_callback` of every task: which task failed, why (one line), where its log and the report are.
    Returns within about `ALERT_DEADLINE_S`, sent or not (the module's docstring says why)."""
    ti = context["ti"]
    key = run_key(ti.dag_id, ti.run_id)
    telemetry.count("task_failed", {"run": key, "task": ti.task_id})
    conn_id, recipients = _usable_settings(context.get("params"), run=key, task=ti.task_id)
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
    conn_id, recipients = _usable_settings(params, run=run_key(DAG_ID, run_id), task="outcome")
    if not conn_id or not recipients:
        return
    text = "\n".join([f"The run {run_id} of {DAG_ID} did not complete.", "", f"Reason: {reason}", "",
                      f"Report: {run_page_url(run_id)}"])
    send_alert(conn_id, recipients, f"[{DAG_ID}] run {run_id} stopped", text, run=run_key(DAG_ID, run_id),
               task="outcome")


def alert_throughput(cfg: RunConfig, run_id: str, warnings: list[str]) -> None:
    """The evaluate task's throughput warnings, as one alert (the report carries them too). Evaluate holds GPU
    slots: the send is bounded by `ALERT_DEADLINE_S` like every alert, and the settings were checked in prepare."""
    alerts = cfg.monitoring
    if not alerts.alert_conn_id or not warnings:
        return
    text = "\n".join([f"The run {run_id} of {DAG_ID} trained, but slower than expected:", "",
                      *(f"- {warning}" for warning in warnings), "", f"Report: {run_page_url(run_id)}"])
    send_alert(alerts.alert_conn_id, alerts.alert_emails, f"[{DAG_ID}] run {run_id}: throughput below expectation",
               text, run=run_key(DAG_ID, run_id), task="evaluate")


def alert_in_background(cfg: RunConfig, run_id: str, what: str, text: str, *, task: str,
                        fails: bool = False) -> threading.Thread:
    """A warning raised while a task holds GPU slots (the idle-held warning, a reclaim of idle GPUs: `fails`, from a
    group's watch loop), mailed on a thread of its own: `send_alert` is bounded by ALERT_DEADLINE_S, but even that
    must not hold up the loop that watches the workers. The settings were checked in prepare; the thread is a daemon
    (the task's end is not held for it: a mail still under way then is lost, and the report keeps the warning)."""
    key = run_key(DAG_ID, run_id)
    verdict = f"its task {task} fails by this" if fails else "it is not failed by this"
    body = "\n".join([f"The run {run_id} of {DAG_ID} needs a look ({verdict}):", "", f"- {text}", "",
                      f"Report: {run_page_url(run_id)}"])
    sender = threading.Thread(target=send_alert, name="gpt-finetune-alert-background", daemon=True, args=(
        cfg.monitoring.alert_conn_id, cfg.monitoring.alert_emails, f"[{DAG_ID}] run {run_id}: {what}", body),
        kwargs={"run": key, "task": task})
    sender.start()
    return sender
