"""Every later task holds the configuration it reads from XCom to the access policy again (issue 37, review
finding 3): a prepared run rewritten after prepare reaches no further than the trigger form could."""

from __future__ import annotations

from dataclasses import replace

import pytest
from airflow.sdk.exceptions import AirflowFailException
from tf_multiworker.backends import make_backend

from tasks.baseline import plan_baseline
from tasks.evaluate import evaluate_run
from tasks.policy import check_launch_urls
from tasks.promote import promote_run
from tests.tasks import run_fixtures

TASKS = {"plan_baseline": lambda prepared: plan_baseline(prepared, run_fixtures.own_run(prepared)),
         "evaluate": lambda prepared: evaluate_run(prepared, run_fixtures.own_run(prepared), make_backend),
         "promote": lambda prepared: promote_run(prepared, run_fixtures.own_run(prepared))}


@pytest.mark.parametrize("task", TASKS)
@pytest.mark.parametrize(("setting", "value"), [("model", "http://169.254.169.254/latest/"),
                                                ("dataset", "/etc/*.txt"), ("storage_root", "/")])
def test_a_prepared_run_rewritten_in_xcom_is_refused_before_the_task_acts(tmp_path, task, setting, value):
    prepared = run_fixtures.prepare_run(str(tmp_path), "manual__rewritten")
    assert TASKS["plan_baseline"](prepared) in (True, False)  # the run as prepare left it passes
    crafted = replace(prepared, config={**prepared.config, setting: value})
    with pytest.raises(AirflowFailException, match=f"configuration is refused: Setting '{setting}'"):
        TASKS[task](crafted)


def test_evaluate_s_launch_urls_are_held_to_the_run_s_layout(tmp_path):
    """Evaluate's own groups (review t5 finding 1): the run's model, a baseline's model and cached evaluation, a
    registered version's model pass; a model anywhere else is refused naming the argument and where it must be."""
    from core.config import ConfigError
    from core.layout import StorageLayout

    root, key = str(tmp_path), "manual__1-0123456789"
    storage = StorageLayout(root)
    run, baseline = storage.run(key), storage.baseline("gpt2-gb16-s40-0123456789abcdef")
    manifest = storage.manifest(run_fixtures.FINGERPRINT)
    for model, output in ((run.train.model, f"{run.report}/eval-distributed.json"),
                          (baseline.model, baseline.evaluation),
                          (storage.model("nightly-chat").version(12).model, f"{run.report}/eval-promoted.json")):
        check_launch_urls(["--model", model, "--manifest", manifest, "--output", output], root, key)
    for model in ("http://127.0.0.1:9/meta", f"{root}/home/.ssh", storage.run("other-0123456789").train.model,
                  f"{storage.model('m').url}/latest.json", storage.base_model("gpt2", "a" * 40)):
        with pytest.raises(ConfigError, match=f"the worker argument --model '{model}' is outside this run's storage "
                                              "layout: it must be "):
            check_launch_urls(["--model", model, "--manifest", manifest], root, key)
