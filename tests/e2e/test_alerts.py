"""Alerts and refusals on a real scheduler: a run whose loss diverges fails in train, naming the step, and the failure
reaches a real SMTP server (the stack's `alerts_smtp` connection, tests/conftest.py) with the task, the reason and
the links; runs whose settings the deployment does not allow fail in prepare, naming the setting, and launch nothing.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from core.layout import run_key
from tests.e2e.runs import DAG, FAST, assert_released, storage, trigger, wait_until

pytestmark = pytest.mark.timeout(900)

RECIPIENTS = ["ops@example.com"]


def test_a_diverging_run_fails_in_train_naming_the_step_and_mails_one_alert(airflow_stack):
    # A learning rate of 1 on the tiny model: the loss jumps from ~5.8 to ~30 at step 2.
    conf = {**FAST, "baseline": "skip", "learning_rate": 1.0, "warmup_steps": 0, "alert_conn_id": "alerts_smtp",
            "alert_emails": RECIPIENTS}
    run_id = trigger(airflow_stack, conf)
    assert airflow_stack.wait_for_run(DAG, run_id, timeout=600) == "failed"
    states = airflow_stack.task_states(DAG, run_id)
    assert (states["train"], states["evaluate"], states["release"]) == ("failed", "upstream_failed", "success"), states
    # No retry: a diverged loss exits EXIT_PERMANENT and the operator fails the task at once (it would diverge the
    # same way: same data, same seed).
    assert "the training loss diverged at step 2" in airflow_stack.task_log(DAG, run_id, "train", 1)
    assert not airflow_stack.task_log(DAG, run_id, "train", 2), "train was retried"

    smtp = airflow_stack.sinks.smtp
    mails = wait_until(lambda: [m for m in smtp.messages if run_id in m["Subject"]], 30, "the alert mail")
    assert len(mails) == 1, [m["Subject"] for m in mails]  # train's; outcome only repeats it
    (mail,) = mails
    assert mail["Subject"] == f"[{DAG}] run {run_id} failed: train" and mail["To"] == RECIPIENTS[0]
    text = smtp.text(mail)
    assert "failed in task train (try 1)" in text
    # Every rank sees the same all-reduced loss and stops at step 2: the reason names whichever exited first.
    assert re.search(r"Reason: rank (\d) \(host [^)]*\) exited with code 65: \S*LossDivergedError: rank \1: "
                     r"the training loss diverged at step 2", text), text
    assert f"/dags/{DAG}/runs/" in text and "/tasks/train?try_number=1" in text
    assert f"/gpt-finetune/runs/{run_key(DAG, run_id)}/" in text
    failed = airflow_stack.sinks.statsd.matching("gpt_finetune.task_failed", run=run_key(DAG, run_id), task="train")
    assert len(failed) == 1
    assert_released(airflow_stack, run_id)


def test_an_alert_connection_that_does_not_exist_is_refused_in_prepare(airflow_stack):
    run_id = trigger(airflow_stack, {**FAST, "alert_conn_id": "no_such_connection", "alert_emails": RECIPIENTS})
    assert airflow_stack.wait_for_run(DAG, run_id, timeout=300) == "failed"
    states = airflow_stack.task_states(DAG, run_id)
    assert states["prepare"] == "failed" and states["preflight"] == "upstream_failed", states
    log = airflow_stack.task_log(DAG, run_id, "prepare")
    assert "'alert_conn_id' = 'no_such_connection': no Airflow connection has this id" in log
    # prepare's own alert cannot go out through that connection: logged, and the task's outcome stays its own.
    assert "Could not send the alert" in log and "the run's outcome is unchanged" in log


def test_a_trigger_outside_the_allow_lists_is_refused_in_prepare_and_launches_nothing(airflow_stack):
    """Issue 37: a storage connection the deployment does not allow (the metadata database's, whose login would
    become the workers' storage keys; tests/conftest.py TEST_ALLOW_LISTS) is refused by name before anything is
    planned or launched. (`image` and `namespace` are checked the same way, with backend kubernetes, whose storage
    must be an s3:// bucket: tests/tasks/test_prepare.py.)"""
    run_id = trigger(airflow_stack, {**FAST, "storage_conn_id": "metadata_db"})
    assert airflow_stack.wait_for_run(DAG, run_id, timeout=300) == "failed"
    states = airflow_stack.task_states(DAG, run_id)
    assert states["prepare"] == "failed", states
    assert {states[task] for task in ("publish", "preflight", "train", "plan_baseline", "baseline", "evaluate")} == {
        "upstream_failed"}, states
    assert not airflow_stack.task_log(DAG, run_id, "prepare", 2), "prepare was retried"
    log = airflow_stack.task_log(DAG, run_id, "prepare")
    assert ("Setting 'storage_conn_id' = 'metadata_db' is outside the storage connections this deployment allows "
            "(GPT_FINETUNE_STORAGE_CONN_IDS=run_storage,elastic_run_storage)") in log, log[-3000:]
    assert "have the operator add it to $GPT_FINETUNE_STORAGE_CONN_IDS" in log
    # Release ran and found nothing to end; the run's storage holds its record and nothing else.
    assert states["release"] == "success", states
    release = assert_released(airflow_stack, run_id)
    assert (release["state_records"], release["processes_found"], release["removed_dirs"]) == ([], [], []), release
    run = Path(storage(airflow_stack).run(run_key(DAG, run_id)).url)
    assert sorted(str(path.relative_to(run)) for path in run.rglob("*")) == ["report", "report/release.json"]
