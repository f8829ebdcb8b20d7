"""One DAG run with storage on S3 reached only through an Airflow connection, shared by the tests that check it
(tests/e2e/test_pipeline.py) and compare against it (tests/e2e/test_ssh_pipeline.py): a full run costs minutes.
And `celery_stack`, the production topology (tests/celery_stack.py) for a test module."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass

import pytest

STORAGE_CONN_ID = "run_storage"
STORAGE_KEY_ID = "conn-only-key"


@dataclass(frozen=True)
class ConnectionStorageRun:
    run_id: str
    state: str
    conf: dict  # the run's conf: storage_root and storage_conn_id included
    bucket: str
    secret: str  # the storage secret key, known only to the connection
    client: object  # boto3 S3 client on the bucket


@pytest.fixture(scope="session")
def connection_storage_run(airflow_stack, s3_endpoint, tmp_path_factory) -> ConnectionStorageRun:
    """A run of {**FAST, baseline: skip} whose S3 endpoint and keys exist only in the `run_storage` connection."""
    import boto3

    from tests.e2e.runs import DAG, FAST, trigger

    secret = f"conn-only-secret-{time.time_ns()}"
    bucket = f"conn-only-{time.time_ns()}"
    client = boto3.client("s3", endpoint_url=s3_endpoint, aws_access_key_id=STORAGE_KEY_ID,
                          aws_secret_access_key=secret, region_name="us-east-1")
    client.create_bucket(Bucket=bucket)
    connection = tmp_path_factory.mktemp("connection") / "connections.json"
    connection.write_text(json.dumps({STORAGE_CONN_ID: {
        "conn_type": "aws", "login": STORAGE_KEY_ID, "password": secret,
        "extra": json.dumps({"endpoint_url": s3_endpoint, "region_name": "us-east-1"})}}))
    airflow_stack.cli("connections", "import", str(connection), "--overwrite")

    conf = {**FAST, "baseline": "skip", "storage_root": f"s3://{bucket}/gpt", "storage_conn_id": STORAGE_CONN_ID}
    run_id = trigger(airflow_stack, conf)
    state = airflow_stack.wait_for_run(DAG, run_id, timeout=600)
    return ConnectionStorageRun(run_id, state, conf, bucket, secret, client)


@pytest.fixture(scope="module")
def celery_stack(tmp_path_factory):
    """A CeleryExecutor stack (tests/celery_stack.py) running the repo's DAGs for one test module, stopped after it."""
    from tests.celery_stack import start_celery_stack, unavailable_reason

    reason = unavailable_reason()
    if reason:
        pytest.skip(reason)
    # As for the standalone stack: no scheduled run holding the active-run slot, quick retries, storage in tmp.
    extra_env = {"GPT_FINETUNE_STORAGE_ROOT": str(tmp_path_factory.mktemp("celery_storage")),
                 "GPT_FINETUNE_SCHEDULE": "none", "GPT_FINETUNE_RETRY_DELAY_S": "2"}
    stack = start_celery_stack(tmp_path_factory.mktemp("celery_home"), extra_env)
    try:
        yield stack
    finally:
        stack.stop()
