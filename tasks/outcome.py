"""The outcome task: the DAG run's verdict, so that a failed, killed or half-released run never ends green.

Airflow judges a run by its leaf tasks and leaves teardowns out unless they set `on_failure_fail_dagrun`; but a
teardown that does set it hides the tasks before it from that judgement. And a run marked failed from the UI or
API while its teardown still has to run is left for the scheduler to judge, from leaves that are now skipped
(apache/airflow: `_set_dag_run_terminal_state` leaves the state unset while a teardown is pending). So this last
teardown reads every task's state and fails when any work task failed, when the run stopped before its final
work task succeeded, or when release failed.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

log = logging.getLogger("gpt_finetune.outcome")

class RunFailedError(RuntimeError):
    """The run did not complete: named tasks failed, or it was stopped before its final work task succeeded."""


def judge_run(task_states: Mapping[str, str | None], *, final_task: str, own_task: str) -> dict[str, str | None]:
    """Raise RunFailedError naming what went wrong; return the states judged when the run completed."""
    states = {task: state for task, state in sorted(task_states.items()) if task != own_task}
    failed = [task for task, state in states.items() if state == "failed"]
    blocked = [task for task, state in states.items() if state == "upstream_failed"]
    if failed or blocked:
        raise RunFailedError(
            f"The run failed: {', '.join(failed) or 'no task'} failed (the cause is in their logs)"
            + (f"; {', '.join(blocked)} did not run (upstream failed)." if blocked else "."))
    if states.get(final_task) != "success":
        raise RunFailedError(
            f"The run stopped before '{final_task}' succeeded (its state: {states.get(final_task)}): it was marked "
            f"failed or its tasks were skipped from outside. States: {states}")
    log.info("Run complete: %s", ", ".join(f"{task}={state}" for task, state in states.items()))
    return states
