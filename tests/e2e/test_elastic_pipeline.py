"""Elastic recovery through the scheduler on two real OpenSSH hosts (tests/support/sshd.py): one host is lost mid-run,
the retried train task continues on the remaining host with `min_workers` = 1 (2 accumulation steps, the same global
batch), and the run succeeds with the baseline parity gate. The lost host comes back before release, which must still
prove it clean."""

from __future__ import annotations

import json
import time

import pytest

from core.layout import run_key
from tasks.release import processes_of_run
from tests.e2e.runs import DAG, FAST, trigger, wait_until
from tests.e2e.test_ssh_pipeline import _connections
from tests.support.sshd import bring_back, take_down

pytestmark = pytest.mark.timeout(900)


def test_a_lost_ssh_host_is_left_out_of_the_retry_and_the_run_passes_its_gates(airflow_stack, ssh_hosts, s3_endpoint,
                                                                                 tmp_path):
    import boto3
    from botocore.exceptions import ClientError

    secret = f"elastic-secret-{time.time_ns()}"
    bucket = f"elastic-{time.time_ns()}"
    s3 = boto3.client("s3", endpoint_url=s3_endpoint, aws_access_key_id="ssh-run-key", aws_secret_access_key=secret,
                      region_name="us-east-1")
    s3.create_bucket(Bucket=bucket)
    file = tmp_path / "connections.json"
    connections = _connections(ssh_hosts)
    connections["elastic_run_storage"] = {"conn_type": "aws", "login": "ssh-run-key", "password": secret,
                                          "extra": json.dumps({"endpoint_url": s3_endpoint,
                                                               "region_name": "us-east-1"})}
    file.write_text(json.dumps(connections))
    airflow_stack.cli("connections", "import", str(file), "--overwrite")
    conf = {**FAST, "backend": "ssh", "ssh_conn_ids": [h.conn_id for h in ssh_hosts], "min_workers": 1,
            "baseline": "run", "max_steps": 200, "checkpoint_every_steps": 20,
            "storage_root": f"s3://{bucket}/gpt", "storage_conn_id": "elastic_run_storage"}
    run_id = trigger(airflow_stack, conf)
    key = run_key(DAG, run_id)

    def stored(name: str) -> dict | None:
        try:
            return json.loads(s3.get_object(Bucket=bucket, Key=f"gpt/runs/{key}/{name}")["Body"].read())
        except ClientError:
            return None

    def checkpointed() -> bool:
        try:
            s3.head_object(Bucket=bucket, Key=f"gpt/runs/{key}/train/checkpoints/checkpoint")
            return True
        except ClientError:
            return False

    lost = ssh_hosts[1]
    wait_until(checkpointed, 600, "the first checkpoint of the train task", interval=0.2)
    take_down(lost)
    try:
        # The retry leaves the lost host out: its launch record names one worker.
        segments = wait_until(lambda: (s := stored("train/segments.json")) and len(s["launches"]) > 1 and s, 300,
                              "the retried train task's launch record")
    finally:
        ssh_hosts[1] = bring_back(lost)  # release must reach every host of the run again
    state = airflow_stack.wait_for_run(DAG, run_id, timeout=600)
    retry_log = airflow_stack.task_log(DAG, run_id, "train", try_number=2)
    assert state == "success", retry_log[-4000:]

    first, retry = segments["launches"]
    assert (first["num_workers"], retry["num_workers"], retry["grad_accum_steps"]) == (2, 1, 2)
    assert retry["from_step"] > 0 and retry["from_step"] % 20 == 0 and retry["hosts"] == [ssh_hosts[0].address]
    assert retry["reason"] == f"host {lost.address} unreachable"
    assert (f"continued on 1 of 2 workers from step {retry['from_step']}: host {lost.address} unreachable"
            in retry_log)
    report = stored("report/report.json")
    assert report["gates_passed"] is True and report["elastic"] is True
    assert {gate["name"]: gate["passed"] for gate in report["gates"]}["loss_parity"] is True
    assert [s["num_workers"] for s in report["segments"]] == [2, 1]
    print(f"\nlost host {lost.address} after step {retry['from_step']}: continued on 1 worker; eval loss delta "
          f"{report['comparison']['loss_delta']:+.2e}")
    assert stored("report/release.json")["clean"] is True
    assert processes_of_run(key) == {}
