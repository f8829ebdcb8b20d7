"""The outcome verdict: any failure, a run stopped from outside, or a failed release fails the DAG run."""

import pytest

from tasks.outcome import RunFailedError, judge_run

COMPLETE = {"prepare": "success", "preflight": "success", "train": "success", "plan_baseline": "success",
            "baseline": "skipped", "evaluate": "success", "release": "success", "outcome": "running"}


def judge(states):
    return judge_run(states, final_task="evaluate", own_task="outcome")


def test_a_complete_run_passes_with_a_reused_baseline():
    assert judge(COMPLETE) == {task: state for task, state in COMPLETE.items() if task != "outcome"}


def test_a_failed_task_fails_the_run_naming_it_and_what_it_blocked():
    with pytest.raises(RunFailedError, match=r"train failed .*; baseline, evaluate, plan_baseline did not run"):
        judge({**COMPLETE, "train": "failed", "plan_baseline": "upstream_failed", "baseline": "upstream_failed",
               "evaluate": "upstream_failed"})


def test_a_failed_release_fails_a_run_whose_work_succeeded():
    with pytest.raises(RunFailedError, match=r"release failed"):
        judge({**COMPLETE, "release": "failed"})


def test_a_run_marked_failed_while_queued_fails_although_nothing_failed():
    """Marking a DAG run failed skips the pending work tasks; skipped must not read as success."""
    with pytest.raises(RunFailedError, match="stopped before 'evaluate' succeeded"):
        judge({**COMPLETE, "train": "skipped", "plan_baseline": "skipped", "evaluate": "skipped"})
