"""What a failed worker group's exit statuses make Airflow do (issue 40, item 7): no retry for a failure that cannot
succeed on retry, a free reschedule for a preemption, the task's retries for anything else.

The mapping directly, then whole runs through Airflow's task runner (`dag.test()`, tests/plugins/harness_dags/
tfmw_harness.py) with the tiny workers of tests/launcher/entrypoints exiting with the protocol's codes.
"""

from __future__ import annotations

import json
import uuid

import pytest
from airflow.sdk.exceptions import AirflowFailException, AirflowRescheduleException
from tf_multiworker.operator import PREEMPTION_MARGIN_S, NotRetryableError, TFMultiWorkerOperator

from core.protocol import EXIT_PERMANENT, EXIT_PREEMPTED
from launcher import FailureKind, GroupState, RunResult, WorkerFailedError, WorkerFailure
from launcher.kubernetes_objects import GroupNames, PodSettings, pod
from tests.plugins.conftest import failure_excerpt
from tests.plugins.test_operator import _case, _finish, _start, prepared_launch
from tests.trainer.long_run import FAST_STEPS, write_tiny_dataset


def _operator(**changes) -> TFMultiWorkerOperator:
    kwargs = {"task_id": "train", "entrypoint": "trainer.train", "args": ["--steps", "3"], "run_key": "r",
              "run_config": {"num_workers": 2, "storage_root": "/tmp/x"}, "preemption_reschedules": 2}
    return TFMultiWorkerOperator(**{**kwargs, **changes})


def _result(*codes: int) -> RunResult:
    failures = {rank: WorkerFailure(rank, "127.0.0.1", 100 + rank, FailureKind.EXIT_CODE, code, 1.0 + rank,
                                    f"exited with code {code}", ("trainer.metrics.LossDivergedError: rank 0: ...",))
                for rank, code in enumerate(codes)}
    return RunResult("train", GroupState.FAILED, (), failures, 1, 2.0, {})


@pytest.mark.parametrize("codes", [(EXIT_PERMANENT, EXIT_PERMANENT), (EXIT_PERMANENT, 1), (EXIT_PREEMPTED, 65)])
def test_a_rank_that_exited_not_retryable_fails_the_task_without_retries(codes):
    error = _operator()._failure(_result(*codes), {"task_reschedule_count": 0})
    assert isinstance(error, AirflowFailException) and isinstance(error, NotRetryableError)
    assert error.result.failures[0].exit_code == codes[0]  # alerts still find the root rank and its error line
    assert "a retry cannot fix this" in str(error) and "exited with code" in str(error)


def test_a_preempted_group_is_rescheduled_until_its_free_reschedules_are_spent():
    operator, result = _operator(preemption_reschedule_delay_s=7), _result(EXIT_PREEMPTED, EXIT_PREEMPTED)
    for done in (0, 1):
        assert isinstance(operator._failure(result, {"task_reschedule_count": done}), AirflowRescheduleException)
    spent = operator._failure(result, {"task_reschedule_count": 2})
    assert type(spent) is WorkerFailedError  # an ordinary failure: the task's retries apply


@pytest.mark.parametrize("codes", [(1,), (EXIT_PREEMPTED, 1), (3, 3), (-9,)])
def test_other_failures_use_the_task_retries(codes):
    error = _operator()._failure(_result(*codes), {"task_reschedule_count": 0})
    assert not isinstance(error, (AirflowFailException, AirflowRescheduleException))


def test_the_group_grace_covers_the_preemption_checkpoint_deadline():
    """The stop ladder's grace, and a pod's terminationGracePeriodSeconds which Kubernetes takes from it, leave the
    preemption checkpoint its whole deadline before SIGKILL."""
    spec = _operator(run_config={"num_workers": 2, "storage_root": "/tmp/x", "preemption_checkpoint_s": 30})
    grace = spec._group_spec().grace_period_s
    assert grace == 30 + PREEMPTION_MARGIN_S
    # The Kubernetes backend gives each pod the group's grace (launcher/kubernetes.py start()).
    body = pod(GroupNames("r", "train", "default"), 0, PodSettings(image="i", grace_period_s=grace), ["python"], {},
               with_secret=False)
    assert body.spec.termination_grace_period_seconds >= 30 + PREEMPTION_MARGIN_S
    assert _operator()._group_spec().grace_period_s == 10.0  # the default 8 s deadline fits the default grace


# -- through Airflow's task runner ------------------------------------------------------------------------------

def _run(airflow_env, tmp_path, manifest: str | None = None, **case) -> tuple[dict, str]:
    """A harness run of `case`; with `manifest`, of a run laid out as prepare does (`prepared_launch`)."""
    harness = {key: case.pop(key) for key in ("retries", "operator_args") if key in case}
    case_file = _case(tmp_path, **case)
    if manifest:
        prepared_launch(case_file, manifest)
    extra = json.loads(case_file.read_text())
    extra["operator_args"] = {**extra.get("operator_args", {}), **harness.pop("operator_args", {})}
    extra.update(harness)
    case_file.write_text(json.dumps(extra))
    process, out, log = _start(airflow_env, case_file, tmp_path)
    _finish(process, timeout=420)
    return json.loads(out.read_text()), log.read_text(errors="replace")


def test_a_not_retryable_exit_fails_the_task_on_its_first_try(airflow_env, tmp_path):
    result, task_log = _run(airflow_env, tmp_path, worker_env={"TINY_WORKER_FAULT": f"1:exit{EXIT_PERMANENT}"},
                            retries=2)
    assert result["task_states"]["group"] == "failed", failure_excerpt(task_log)
    assert result["try_numbers"]["group"] == 1, "the task was retried"
    assert "NotRetryableError" in task_log and f"exited with code {EXIT_PERMANENT}" in task_log
    assert task_log.count("attempt 1 of 3 on backend local") == 1  # one launch in all


def test_a_preempted_group_runs_again_without_spending_a_retry(airflow_env, tmp_path):
    # No retries at all: the second run can only come from the reschedule.
    result, task_log = _run(airflow_env, tmp_path, worker_env={"TINY_WORKER_FAULT": f"1:exit{EXIT_PREEMPTED}"},
                            retries=0, operator_args={"preemption_reschedules": 1, "preemption_reschedule_delay_s": 1})
    assert task_log.count("attempt 1 of 3 on backend local") == 2, failure_excerpt(task_log)
    assert "rescheduled in 1 s without spending a retry (1 of 1)" in task_log
    assert "was preempted again after 1 free reschedule(s)" in task_log
    assert result["task_states"]["group"] == "failed" and result["try_numbers"]["group"] == 1


def test_a_group_held_idle_is_reclaimed_and_fails_the_task_on_its_first_try(airflow_env, tmp_path):
    """Tiny workers that talk but no longer train: reclaimed after reclaim_idle_after_s, each rank saves its
    checkpoint on the SIGTERM, and the task fails on try 1 although it has 2 retries."""
    checkpoints = tmp_path / "checkpoints"
    result, task_log = _run(airflow_env, tmp_path, retries=2, max_idle_held_s=1, reclaim_idle_after_s=2, worker_env={
        "TINY_WORKER_STEPS": "100000", "TINY_WORKER_STEP_S": "0.1", "TINY_WORKER_LIVE_STEPS": "3",
        "TINY_WORKER_CHECKPOINT_ON_TERM": str(checkpoints)})
    assert result["task_states"]["group"] == "failed", failure_excerpt(task_log)
    assert result["try_numbers"]["group"] == 1, "the task was retried"
    assert "IdleReclaimedError" in task_log and "reclaimed after 2 s idle: GPU time: group (attempt 1)" in task_log
    assert "the task fails without spending its retries" in task_log
    assert task_log.count("attempt 1 of 3 on backend local") == 1  # one launch in all
    assert sorted(path.name.split("-step-")[0] for path in checkpoints.iterdir()) == ["rank-0", "rank-1"]


def test_a_diverged_loss_fails_train_on_its_first_try_through_the_task_runner(airflow_env, tmp_path):
    """The real trainer on 2 tiny CPU workers: the loss diverges, every rank exits 65 and the task fails on try 1
    although it has 2 retries."""
    storage, key = tmp_path / "storage", f"diverged-{uuid.uuid4().hex[:8]}"
    result, task_log = _run(airflow_env, tmp_path, manifest=write_tiny_dataset(storage / "datasets"),
                            entrypoint="trainer.train", retries=2, startup_timeout_s=240, run_key=key,
                            **{**FAST_STEPS, "max_steps": 200, "learning_rate": 1.0, "warmup_steps": 0,
                               "max_loss_rise": 0.5})
    assert result["task_states"]["group"] == "failed", failure_excerpt(task_log)
    assert result["try_numbers"]["group"] == 1, "train was retried"
    assert "NotRetryableError" in task_log and f"exited with code {EXIT_PERMANENT}" in task_log
    assert "LossDivergedError: rank" in task_log and "the training loss diverged at step" in task_log
