"""The DAG file: parses cleanly and cheaply, wires the stages as designed, exposes every run setting as a Param."""

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple

import pytest

from core.config import RunConfig, field_names

REPO = Path(__file__).resolve().parents[2]
DAG_FILE = REPO / "dags" / "gpt_finetune.py"


@pytest.fixture(scope="module")
def dag():
    from airflow.dag_processing.dagbag import DagBag

    bag = DagBag(dag_folder=str(REPO / "dags"))
    assert bag.import_errors == {}
    return bag.dags["gpt_finetune"]


def test_dag_folder_has_no_import_errors(dag):
    assert dag.dag_id == "gpt_finetune"


def test_task_graph(dag):
    downstream = {t.task_id: sorted(t.downstream_task_ids) for t in dag.tasks}
    assert downstream == {
        "prepare": ["tokenize"],
        "tokenize": ["publish"],
        "publish": ["evaluate", "plan_baseline", "preflight"],
        "preflight": ["train"],
        "train": ["plan_baseline"],
        "plan_baseline": ["baseline"],
        "baseline": ["evaluate"],
        "evaluate": ["promote"],
        "promote": ["release"],
        "release": ["outcome"],
        "outcome": [],
    }


def test_tokenize_is_mapped_over_the_lanes_and_publish_runs_when_it_has_none(dag):
    from airflow.sdk.definitions.mappedoperator import MappedOperator

    tokenize = dag.get_task("tokenize")
    assert isinstance(tokenize, MappedOperator) and tokenize.retries == 2
    assert dag.get_task("publish").trigger_rule == "none_failed"  # a one-lane plan skips tokenize
    assert [asset.name for asset in dag.get_task("publish").outlets] == ["gpt_finetune_shards"]


def test_release_cross_checks_the_state_records_of_every_worker_group_task(dag):
    """Release compares the stored state records with those the operators pushed to XCom (review t5, finding 4):
    it must ask every task that launches a worker group."""
    from tf_multiworker.operator import TFMultiWorkerOperator

    groups = sorted(t.task_id for t in dag.tasks if isinstance(t, TFMultiWorkerOperator))
    module = next(m for m in list(sys.modules.values()) if getattr(m, "__file__", None) == str(DAG_FILE))
    assert groups == sorted(module.WORKER_GROUP_TASKS) == ["baseline", "preflight", "train"]


def test_release_and_outcome_are_teardowns_that_run_whatever_happened(dag):
    for task_id in ("release", "outcome"):
        teardown = dag.get_task(task_id)
        assert teardown.is_teardown and teardown.on_failure_fail_dagrun, task_id
        assert teardown.trigger_rule == "all_done_setup_success"
    assert not [t for t in dag.tasks if t.is_setup]  # no setups: the rule reduces to all_done
    assert dag.get_task("evaluate").trigger_rule == "none_failed"  # runs when the baseline is skipped
    assert dag.get_task("promote").trigger_rule == "all_done"  # failed gates still get a "not promoted" verdict
    assert dag.get_task("outcome").retries == 0


def test_the_run_state_is_judged_by_outcome_alone(dag):
    """Airflow's own leaf rule: only outcome decides, so it must see every failure (tests/tasks/test_outcome.py)."""
    from airflow.models.dagrun import DagRun

    class TaskInstance(NamedTuple):
        task_id: str
        state: str

    tis = [TaskInstance(task.task_id, "success") for task in dag.tasks]
    judged = DagRun._tis_for_dagrun_state(None, dag=dag, tis=tis)
    assert [ti.task_id for ti in judged] == ["outcome"]


def test_schedule_and_run_policy(dag):
    assert dag.schedule == "0 2 * * *"
    assert dag.catchup is False
    assert dag.max_active_runs == 1
    assert {"gpt", "tensorflow"} <= set(dag.tags)
    assert dag.doc_md and "num_workers" in dag.doc_md
    assert dag.get_task("train").retries == 1
    assert dag.get_task("prepare").retries == 1  # invalid settings fail at once (AirflowFailException)
    assert dag.get_task("preflight").retries == 0


def test_schedule_is_overridable_by_environment():
    code = f"import runpy; ns = runpy.run_path({str(DAG_FILE)!r}); print(ns['SCHEDULE'])"
    env = dict(os.environ, GPT_FINETUNE_SCHEDULE="30 4 * * 1")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split()[-5:] == ["30", "4", "*", "*", "1"]
    env["GPT_FINETUNE_SCHEDULE"] = "none"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split()[-1] == "None"


def test_params_are_generated_from_the_schema_in_its_order(dag):
    from core.config import SETTINGS

    params = dag.params.dump()
    assert list(params) == [setting.name for setting in SETTINGS]
    assert sorted(params) == sorted(field_names())
    defaults = RunConfig().settings()
    for name, value in params.items():
        if name != "storage_root":  # the DAG's default comes from the environment
            assert value == defaults[name], name
    RunConfig.from_params(params)  # the form's defaults form a valid run


# A value each format refuses; every setting with a pattern (of its own or of its items) needs one here.
BAD_FORMATS = {
    "model_name": "-model", "model_revision": "main branch", "namespace": "Team_A", "image": "trainer image:1",
    "cpu": "4 cores", "memory": "16 GB", "remote_python": "venv/bin/python", "gpu_queue": "gpu,cpu",
    "alert_conn_id": "smtp conn", "ssh_conn_ids": ["host a"], "alert_emails": ["ops@example.com\nBcc: x@y.z"],
    "text_column": "text` <b>x</b>", "lora_targets": ["c-attn"],
}


def _refusals():
    """(setting, value) pairs the schema refuses: each bound's first value outside it, a value of no enum, a value
    of no format."""
    from core.config import SETTINGS

    for setting in SETTINGS:
        rules = setting.rules
        step = 1 if setting.type == "integer" else 0.5
        if "minimum" in rules:
            yield setting.name, rules["minimum"] - step
        if "exclusiveMinimum" in rules:
            yield setting.name, rules["exclusiveMinimum"]
        if "maximum" in rules:
            yield setting.name, rules["maximum"] + step
        if "enum" in rules:
            yield setting.name, "bogus"
        if "enum" in rules.get("items", {}):
            yield setting.name, ["bogus"]
        if "pattern" in rules or "pattern" in rules.get("items", {}):
            yield setting.name, BAD_FORMATS[setting.name]
        if "maxLength" in rules:
            yield setting.name, "a" * (rules["maxLength"] + 1)
        if "maxLength" in rules.get("items", {}):
            yield setting.name, ["a" * (rules["items"]["maxLength"] + 1)]


@pytest.mark.parametrize(("name", "value"), list(_refusals()), ids=lambda v: v if isinstance(v, str) else None)
def test_the_form_refuses_what_the_run_config_refuses(dag, name, value):
    """Bounds, enums and formats are written once (core/config/schema.py): the trigger form and RunConfig refuse
    the same values, the config naming the setting."""
    from airflow.sdk.definitions.param import ParamValidationError

    from core.config import ConfigError

    with pytest.raises(ParamValidationError):
        dag.params.get_param(name).resolve(value=value)
    with pytest.raises(ConfigError, match=f"'{name}'"):
        RunConfig.from_params({name: value})


def test_every_format_has_a_refusal_to_test():
    from core.config import SETTINGS

    patterned = {s.name for s in SETTINGS if "pattern" in s.rules or "pattern" in s.rules.get("items", {})}
    assert patterned == set(BAD_FORMATS)


def test_parsing_imports_no_heavy_library():
    code = f"""
import json, runpy, sys
runpy.run_path({str(DAG_FILE)!r})
heavy = sorted(m for m in sys.modules if m.split('.')[0] in {{'tensorflow', 'transformers', 'datasets', 'tf_keras',
                                                              'keras', 'tokenizers', 'matplotlib', 'pyarrow'}})
print(json.dumps(heavy))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []


def test_worker_groups_read_the_prepared_paths(dag):
    train, baseline, preflight = (dag.get_task(t) for t in ("train", "baseline", "preflight"))
    assert train.entrypoint == baseline.entrypoint == "trainer.train"
    assert preflight.entrypoint == "trainer.preflight"
    assert "'config_url'" in train.config_url and "'train_url'" in train.output_url
    assert "'baseline_config_url'" in baseline.config_url and "'baseline_url'" in baseline.output_url
    assert train.args[0] == "--manifest" and "'manifest_url'" in train.args[1]
    assert baseline.num_workers == 1 and train.num_workers is None and preflight.num_workers is None
    assert train.run_config == baseline.run_config == preflight.run_config  # the prepared configuration, once
    assert train.run_config.endswith("['config'] }}")
    assert "'train_summary_url'" in train.summary_url and "'baseline_summary_url'" in baseline.summary_url


def test_train_recovers_on_fewer_workers_and_preflight_reads_the_baseline_step_time(dag):
    from tf_multiworker.elastic import ElasticTrainOperator

    assert isinstance(dag.get_task("train"), ElasticTrainOperator)
    assert not isinstance(dag.get_task("baseline"), ElasticTrainOperator)
    preflight = dag.get_task("preflight")
    assert preflight.args[-2] == "--baseline-summary" and "'baseline_summary_url'" in preflight.args[-1]


def test_every_task_but_outcome_alerts_when_it_fails(dag):
    """Outcome only repeats another task's failure (or alerts itself for a run stopped from outside)."""
    for task in dag.tasks:
        callbacks = task.on_failure_callback or []
        names = [getattr(c, "__name__", "") for c in (callbacks if isinstance(callbacks, list) else [callbacks])]
        assert names == ([] if task.task_id == "outcome" else ["alert_task_failure"]), task.task_id
