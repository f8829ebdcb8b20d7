"""Every later task holds the configuration it reads from XCom to the access policy again (issue 37, review
finding 3): a prepared run rewritten after prepare reaches no further than the trigger form could."""

from __future__ import annotations

from dataclasses import replace

import pytest
from airflow.sdk.exceptions import AirflowFailException
from tf_multiworker.backends import make_backend

from tasks.baseline import plan_baseline
from tasks.evaluate import evaluate_run
from tasks.promote import promote_run
from tests.tasks import run_fixtures

TASKS = {"plan_baseline": plan_baseline, "evaluate": lambda prepared: evaluate_run(prepared, make_backend),
         "promote": promote_run}


@pytest.mark.parametrize("task", TASKS)
@pytest.mark.parametrize(("setting", "value"), [("model", "http://169.254.169.254/latest/"),
                                                ("dataset", "/etc/*.txt"), ("storage_root", "/")])
def test_a_prepared_run_rewritten_in_xcom_is_refused_before_the_task_acts(tmp_path, task, setting, value):
    prepared = run_fixtures.prepare_run(str(tmp_path), "manual__rewritten")
    assert TASKS["plan_baseline"](prepared) in (True, False)  # the run as prepare left it passes
    crafted = replace(prepared, config={**prepared.config, setting: value})
    with pytest.raises(AirflowFailException, match=f"configuration is refused: Setting '{setting}'"):
        TASKS[task](crafted)
