"""Triggering through the real CLI against a running scheduler: bad settings never reach the workers."""

import json

import pytest

pytestmark = pytest.mark.timeout(420)


def trigger(stack, conf: dict, check: bool = True):
    return stack.cli("dags", "trigger", "gpt_finetune", "--conf", json.dumps(conf), check=check)


def run_count(stack) -> int:
    return stack.rest("GET", "/api/v2/dags/gpt_finetune/dagRuns?limit=1")["total_entries"]


def test_out_of_range_setting_is_refused_before_a_run_exists(airflow_stack):
    airflow_stack.wait_for_dag("gpt_finetune")
    before = run_count(airflow_stack)  # the session's stack may hold runs of other test files
    result = trigger(airflow_stack, {"num_workers": 0}, check=False)
    assert result.returncode != 0
    assert "Invalid input for param num_workers: 0 is less than the minimum of 1" in result.stderr + result.stdout
    wrong_type = trigger(airflow_stack, {"num_workers": "4"}, check=False)
    assert wrong_type.returncode != 0
    assert "Invalid input for param num_workers: '4' is not of type 'integer'" in wrong_type.stderr + wrong_type.stdout
    assert run_count(airflow_stack) == before


def test_unknown_setting_fails_the_first_task_with_a_clear_message(airflow_stack):
    airflow_stack.wait_for_dag("gpt_finetune")
    run_id = airflow_stack.cli_json(
        "dags", "trigger", "gpt_finetune", "--conf", json.dumps({"num_workers": 2, "num_wokers": 3})
    )[0]["dag_run_id"]
    assert airflow_stack.wait_for_run("gpt_finetune", run_id, timeout=240) == "failed"
    log = airflow_stack.task_log("gpt_finetune", run_id, "prepare")
    assert "Unknown run setting(s) ['num_wokers']" in log
    assert "allowed keys are" in log
    by_task = airflow_stack.task_states("gpt_finetune", run_id)
    assert by_task["prepare"] == "failed"
    assert by_task["train"] == "upstream_failed"
    assert by_task["preflight"] == "upstream_failed"
