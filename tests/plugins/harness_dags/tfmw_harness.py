"""A one-task DAG that runs TFMultiWorkerOperator through Airflow's real task runner (`dag.test()`).

    TFMW_HARNESS_CASE=case.json python tests/plugins/harness_dags/tfmw_harness.py OUT.json

`dag.test()` runs only DAGs found in the DAGs folder, so the tests point AIRFLOW__CORE__DAGS_FOLDER here and the
file builds its DAG from the case named by TFMW_HARNESS_CASE (the operator's arguments, templated where the real
DAG templates them, rendered as native objects: params `run_config`, the prepared run's configuration, and
`run_key`). A downstream task that always runs pulls the operator's XComs; OUT gets them and every task's state.
The tests run this as a subprocess so they can send it SIGTERM.

Optional case keys: "operator": "elastic" (ElasticTrainOperator), "retries" (with a 1 s delay), "operator_args"
(more keyword arguments of the operator), "shared_disk": true (the workers share this machine's disk, as the fake
Kubernetes cluster's pods do: RunConfig's rule that pods need an s3:// storage root is lifted here), and "env_by_try":
{"<try_number>": {VAR: value or null}} applied to this process's environment before each try (what the launcher's
backend reads, and what workers inherit for TFMW_* names).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pendulum
from airflow.sdk import DAG, task
from tf_multiworker.elastic import ElasticTrainOperator
from tf_multiworker.operator import STATE_XCOM_KEY, TFMultiWorkerOperator

CASE = json.loads(Path(os.environ["TFMW_HARNESS_CASE"]).read_text())
XCOM_FILE = Path(os.environ["TFMW_HARNESS_CASE"]).with_suffix(".xcom.json")
if CASE.get("shared_disk"):
    import core.config.launch as launch_rules

    launch_rules._check_shared_storage = lambda *args: None


def environment_for_try(context) -> None:
    for name, value in CASE.get("env_by_try", {}).get(str(context["ti"].try_number), {}).items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value

with DAG("tfmw_harness", schedule=None, start_date=pendulum.datetime(2026, 1, 1, tz="UTC"),
         render_template_as_native_obj=True, params=CASE["params"]) as dag:
    operator = ElasticTrainOperator if CASE.get("operator") == "elastic" else TFMultiWorkerOperator
    group = operator(
        task_id="group",
        entrypoint=CASE["entrypoint"],
        args=CASE["args"],
        run_config="{{ params.run_config }}",
        run_key="{{ params.run_key }}",
        env=CASE["env"],
        retries=CASE.get("retries", 0),
        retry_delay=pendulum.duration(seconds=1),
        pre_execute=environment_for_try,
        **CASE.get("operator_args", {}),
    )

    @task(trigger_rule="all_done")
    def collect(ti=None) -> None:
        XCOM_FILE.write_text(json.dumps({
            "state_record": ti.xcom_pull(task_ids="group", key=STATE_XCOM_KEY),
            "summary": ti.xcom_pull(task_ids="group"),
        }))

    group >> collect()


if __name__ == "__main__":
    run = dag.test()
    from airflow.models.taskinstance import TaskInstance
    from airflow.utils.session import create_session

    with create_session() as session:
        instances = session.query(TaskInstance).filter_by(dag_id=dag.dag_id, run_id=run.run_id).all()
        states = {ti.task_id: str(ti.state) for ti in instances}
        tries = {ti.task_id: ti.try_number for ti in instances}
    Path(sys.argv[1]).write_text(json.dumps({"task_states": states, "try_numbers": tries,
                                             **json.loads(XCOM_FILE.read_text())}))
