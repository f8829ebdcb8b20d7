"""Helpers for the operator and Airflow glue tests: task logs, a migrated Airflow home, a local S3 server."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
HARNESS_DAGS = Path(__file__).resolve().parent / "harness_dags"

_EXCEPTION_LINE = re.compile(r"^[\w.]+(Error|Exception): ", re.MULTILINE)


def failure_excerpt(task_log: str, limit: int = 6000) -> str:
    """What a run that should have passed prints: the task's exception with the launcher's whole message (each
    rank's cause and its last lines), which a plain tail cuts off when the log after it is long; else the tail."""
    failed = task_log.find("Task failed with exception")
    match = failed >= 0 and _EXCEPTION_LINE.search(task_log, failed)
    return task_log[match.start():match.start() + limit] if match else task_log[-limit:]


@pytest.fixture(scope="session")
def s3_server(s3_endpoint):
    """The session's S3-protocol server (tests/support/s3server.py) with bucket `runs`; yields its endpoint URL."""
    import boto3

    boto3.client("s3", endpoint_url=s3_endpoint, region_name="us-east-1", aws_access_key_id="test-key",
                 aws_secret_access_key="test-secret").create_bucket(Bucket="runs")
    return s3_endpoint


@pytest.fixture(scope="session")
def airflow_env(tmp_path_factory) -> dict[str, str]:
    """An Airflow home with a migrated database and tests/plugins/harness_dags as its DAG folder, for the runs
    through the task runner (tests/plugins/test_operator*.py): one `airflow db migrate` serves them all."""
    home = tmp_path_factory.mktemp("airflow_home")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AIRFLOW", "AWS_"))}
    env.update({
        "AIRFLOW_HOME": str(home),
        "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": f"sqlite:///{home}/airflow.db",
        "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
        "AIRFLOW__CORE__DAGS_FOLDER": str(HARNESS_DAGS),
        # This checkout's plugins too: an editable install may point the environment at another checkout's.
        "PYTHONPATH": os.pathsep.join((str(REPO), str(REPO / "plugins"))),
    })
    subprocess.run([sys.executable, "-m", "airflow", "db", "migrate"], env=env, check=True, capture_output=True,
                   timeout=180)
    return env
