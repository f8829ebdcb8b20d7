"""A one-task DAG whose task fails, with the project's failure callback (tasks.alerts.alert_task_failure), run
through Airflow's task runner by `dag.test()`: what sending the alert does to the task's outcome.

    python tests/plugins/alert_dags/alert_harness.py OUT.json

The alert settings are the params; the connection `alerts_silent` comes from the environment (the test points it
at a server that never answers). OUT gets the task's state and how long the run took.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pendulum
from airflow.sdk import DAG, task

from tasks.alerts import alert_task_failure

with DAG("alert_harness", schedule=None, start_date=pendulum.datetime(2026, 1, 1, tz="UTC"),
         params={"alert_conn_id": "alerts_silent", "alert_emails": ["ops@example.com"]}) as dag:

    @task(retries=0, on_failure_callback=alert_task_failure)
    def fails() -> None:
        raise ValueError("the task's own failure")

    fails()


if __name__ == "__main__":
    started = time.monotonic()
    run = dag.test()
    elapsed = time.monotonic() - started
    from airflow.models.taskinstance import TaskInstance
    from airflow.utils.session import create_session

    with create_session() as session:
        states = {ti.task_id: str(ti.state) for ti in
                  session.query(TaskInstance).filter_by(dag_id=dag.dag_id, run_id=run.run_id)}
    Path(sys.argv[1]).write_text(json.dumps({"task_states": states, "elapsed_s": elapsed}))
