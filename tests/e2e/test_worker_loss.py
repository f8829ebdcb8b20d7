"""Runs that lose their workers or are stopped from outside, on a real scheduler: a worker SIGKILLed mid-training
(with and without a successful retry), the task runner SIGKILLed (no cleanup runs: the launcher's guard ends the
group), train or the whole run marked failed. Release always runs and leaves no process of the run.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest

from core.layout import run_key
from tasks.release import processes_of_run
from tests.e2e.runs import (
    DAG,
    LONG,
    assert_released,
    run_path,
    storage,
    task_runner_pid,
    trigger,
    wait_until,
    worker_ranks,
)

pytestmark = pytest.mark.timeout(900)


def test_sigkilled_worker_fails_the_attempt_and_the_retry_resumes_from_the_checkpoint(airflow_stack):
    run_id = trigger(airflow_stack, LONG)
    key = run_key(DAG, run_id)
    train = storage(airflow_stack).run(key).train
    wait_until(lambda: Path(train.checkpoints, "checkpoint").exists(), 400, "first checkpoint of attempt 1")
    ranks = wait_until(lambda: len(found := worker_ranks(key)) == 2 and found, 30, "both trainer workers")
    os.kill(ranks[1], signal.SIGKILL)

    assert airflow_stack.wait_for_run(DAG, run_id, timeout=600) == "success"
    first_attempt = airflow_stack.task_log(DAG, run_id, "train", try_number=1)
    assert "rank 1" in first_attempt and "SIGKILL" in first_attempt
    # The survivor is aborted at once: it cannot agree on a preemption checkpoint without rank 1 (issue 47, item 4).
    assert "rank(s) [1] failed: stopping what is left of rank(s)" in first_attempt and "with SIGUSR1" in first_attempt
    assert "after SIGTERM: sending SIGKILL" not in first_attempt
    retry = airflow_stack.task_log(DAG, run_id, "train", try_number=2)
    assert "resuming" in retry
    summary = json.loads(Path(train.summary).read_text())
    assert summary["resumed_from_step"] >= LONG["checkpoint_every_steps"]
    assert summary["steps"] == LONG["max_steps"]
    assert_released(airflow_stack, run_id)


def test_worker_killed_in_every_attempt_fails_the_run_and_release_still_cleans_up(airflow_stack):
    """Attempt 1 loses a worker (SIGKILL); attempt 2 loses the task's own process (SIGKILL of the task runner, as the
    OOM killer would), which runs no cleanup: the launcher's guard ends its workers within 10 s."""
    run_id = trigger(airflow_stack, LONG)
    key = run_key(DAG, run_id)
    for attempt in (1, 2):
        # Both ranks: the scan can catch the group while only one of them has started.
        ranks = wait_until(lambda: len(found := worker_ranks(key)) == 2 and found, 400,
                           f"both trainer workers of attempt {attempt}")
        if attempt == 1:
            os.kill(ranks[0], signal.SIGKILL)
            wait_until(lambda: not worker_ranks(key), 60, f"attempt {attempt}'s group to be stopped")
            continue
        os.kill(task_runner_pid(airflow_stack, run_id, "train"), signal.SIGKILL)
        killed = time.monotonic()
        wait_until(lambda: not processes_of_run(key), 10, "every worker gone after SIGKILL of the task runner", 0.1)
        print(f"SIGKILL of train's task runner: every worker gone after {time.monotonic() - killed:.1f} s")
    assert airflow_stack.wait_for_run(DAG, run_id, timeout=300) == "failed"
    states = airflow_stack.task_states(DAG, run_id)
    assert states["train"] == "failed" and states["release"] == "success", states
    assert states["evaluate"] == "upstream_failed" and states["outcome"] == "failed"
    assert "train failed" in airflow_stack.task_log(DAG, run_id, "outcome")
    assert_released(airflow_stack, run_id)


def test_marking_train_failed_from_outside_ends_every_worker_within_10_seconds(airflow_stack):
    run_id = trigger(airflow_stack, LONG)
    key = run_key(DAG, run_id)
    wait_until(lambda: len(worker_ranks(key)) == 2, 400, "both trainer workers")
    airflow_stack.rest("PATCH", f"{run_path(run_id)}/taskInstances/train", {"new_state": "failed"})
    marked = time.monotonic()
    wait_until(lambda: not processes_of_run(key), 10, "every worker gone after the task was marked failed", 0.1)
    stopped_after_s = time.monotonic() - marked
    print(f"workers gone {stopped_after_s:.1f} s after train was marked failed")
    assert stopped_after_s <= 10

    assert airflow_stack.wait_for_run(DAG, run_id, timeout=300) == "failed"
    assert airflow_stack.task_states(DAG, run_id)["release"] == "success"
    assert_released(airflow_stack, run_id)


def test_marking_the_whole_run_failed_leaves_it_failed_and_release_still_runs(airflow_stack):
    """The UI's "mark run as failed": Airflow kills the running task, skips the rest and leaves the teardowns."""
    run_id = trigger(airflow_stack, LONG)
    key = run_key(DAG, run_id)
    wait_until(lambda: len(worker_ranks(key)) == 2, 400, "both trainer workers")
    airflow_stack.rest("PATCH", run_path(run_id), {"state": "failed"})

    assert airflow_stack.wait_for_run(DAG, run_id, timeout=300) == "failed"
    states = airflow_stack.task_states(DAG, run_id)
    assert states["train"] == "failed" and states["evaluate"] == "skipped", states
    assert states["release"] == "success" and states["outcome"] == "failed", states
    assert_released(airflow_stack, run_id)
