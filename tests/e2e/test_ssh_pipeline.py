"""The whole DAG with `backend=ssh` on two real OpenSSH hosts (127.0.0.2, 127.0.0.3; tests/support/sshd.py) and storage
on the local S3-protocol server: through the scheduler (next to the same run on the local backend, which must give the
same eval loss) and through `airflow dags test` (what `make demo` runs). The local run compared against keeps its
storage endpoint and keys only in an Airflow connection, which every task, release included, must reach without the
secret showing in any log or command line.

The hosts share this machine's kernel, so these runs prove the launcher, agent, placement, streaming, storage-only
data path and release across SSH, not separate machines (see docs/backends.md).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from core.layout import run_key
from tasks.release import processes_of_run
from tests.e2e.runs import (
    DAG,
    FAST,
    LONG,
    assert_no_library_noise,
    run_path,
    task_runner_pid,
    trigger,
    wait_until,
    worker_ranks,
)
from tests.support.airflow_stack import REPO, airflow_env, free_port

pytestmark = pytest.mark.timeout(900)

SSH_FAST = {**FAST, "baseline": "skip"}
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


@pytest.fixture(scope="module")
def connection_storage_run(airflow_stack, s3_endpoint, tmp_path_factory) -> ConnectionStorageRun:
    """A run of {**FAST, baseline: skip} whose S3 endpoint and keys exist only in the `run_storage` connection."""
    import boto3

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


def test_storage_credentials_only_in_an_airflow_connection(airflow_stack, connection_storage_run):
    """S3 storage whose endpoint and keys exist only in an Airflow connection: every task reaches it, release
    included, and the secret appears in no log (the run of `connection_storage_run`, which the SSH run must match)."""
    assert not [name for name in airflow_stack.env if name.startswith("AWS_")]
    run_id, secret, bucket, client = (connection_storage_run.run_id, connection_storage_run.secret,
                                      connection_storage_run.bucket, connection_storage_run.client)
    assert connection_storage_run.state == "success"
    assert set(airflow_stack.task_states(DAG, run_id).values()) <= {"success", "skipped"}

    key = run_key(DAG, run_id)
    release = json.loads(client.get_object(Bucket=bucket, Key=f"gpt/runs/{key}/report/release.json")["Body"].read())
    assert release["clean"] is True
    report = client.get_object(Bucket=bucket, Key=f"gpt/runs/{key}/report/report.md")["Body"].read().decode()
    assert "**Released: yes**" in report
    rank_logs = [item["Key"] for item in client.list_objects_v2(Bucket=bucket, Prefix=f"gpt/runs/{key}/logs/")
                 ["Contents"]]
    assert rank_logs
    for name in rank_logs:
        assert secret.encode() not in client.get_object(Bucket=bucket, Key=name)["Body"].read(), name
    task_logs = list((airflow_stack.home / "logs" / f"dag_id={DAG}" / f"run_id={run_id}").rglob("*"))
    assert [path for path in task_logs if path.is_file()]
    for path in [*task_logs, airflow_stack.log_path]:
        if path.is_file():
            assert secret not in path.read_text(errors="replace"), path


def _cmdline_watch(secret: str) -> tuple[threading.Event, list[str]]:
    """Scan every process's command line until stopped; collect any that holds `secret`."""
    stop, found = threading.Event(), []

    def scan():
        while not stop.is_set():
            for entry in Path("/proc").iterdir():
                try:
                    if secret.encode() in (entry / "cmdline").read_bytes():
                        found.append(entry.name)
                except OSError:
                    continue
            time.sleep(0.2)

    threading.Thread(target=scan, daemon=True).start()
    return stop, found


def _connections(ssh_hosts) -> dict:
    return {host.conn_id: {**host.connection(), "extra": json.dumps(host.connection()["extra"])} for host in ssh_hosts}


def test_ssh_run_through_the_scheduler_matches_the_local_backend(airflow_stack, ssh_hosts, connection_storage_run,
                                                                 tmp_path):
    # The local run to match is `connection_storage_run`: the same conf, storage and connection.
    local_id, secret, bucket, s3 = (connection_storage_run.run_id, connection_storage_run.secret,
                                    connection_storage_run.bucket, connection_storage_run.client)
    assert connection_storage_run.state == "success"
    file = tmp_path / "connections.json"
    file.write_text(json.dumps(_connections(ssh_hosts)))
    airflow_stack.cli("connections", "import", str(file), "--overwrite")
    common = connection_storage_run.conf

    stop, in_argv = _cmdline_watch(secret)
    try:
        ssh_id = trigger(airflow_stack, {**common, "backend": "ssh", "ssh_conn_ids": [h.conn_id for h in ssh_hosts]})
        state = airflow_stack.wait_for_run(DAG, ssh_id, timeout=600)
    finally:
        stop.set()
    train_log = airflow_stack.task_log(DAG, ssh_id, "train")
    assert state == "success", train_log[-4000:]

    def stored(run_id: str, name: str) -> dict:
        key = f"gpt/runs/{run_key(DAG, run_id)}/{name}"
        return json.loads(s3.get_object(Bucket=bucket, Key=key)["Body"].read())

    local, ssh = stored(local_id, "report/report.json"), stored(ssh_id, "report/report.json")
    delta = abs(ssh["runs"]["distributed"]["eval_loss"] - local["runs"]["distributed"]["eval_loss"])
    print(f"\neval loss local {local['runs']['distributed']['eval_loss']:.6f} vs ssh "
          f"{ssh['runs']['distributed']['eval_loss']:.6f}: |delta| {delta:.2e}")
    assert delta <= 1e-4
    preflight = stored(ssh_id, "report/preflight.json")
    assert preflight["status"] == "passed"
    assert [w["address"].rsplit(":", 1)[0] for w in preflight["workers"]] == [h.address for h in ssh_hosts]
    for rank, host in enumerate(ssh_hosts):
        assert f"[rank {rank} host {host.address}]" in train_log
    release = stored(ssh_id, "report/release.json")
    assert release["clean"] is True
    assert {h["host"] for h in release["hosts"] if h["backend"] == "ssh"} == {h.address for h in ssh_hosts}
    assert processes_of_run(run_key(DAG, ssh_id)) == {}
    assert in_argv == [], "the storage secret appeared in a command line"
    logs = [p for p in (airflow_stack.home / "logs" / f"dag_id={DAG}" / f"run_id={ssh_id}").rglob("*") if p.is_file()]
    assert logs and not [p for p in logs if secret in p.read_text(errors="replace")]
    assert_no_library_noise("\n".join(p.read_text(errors="replace") for p in logs))


def test_readme_command_runs_the_whole_dag_on_ssh_hosts(ssh_hosts, host_network, tmp_path):
    """`make demo-s3` with `--conf '{"backend": "ssh", ...}'` in DEMO_ARGS, in miniature, with the hosts' connections
    set by environment as a deployment would."""
    extra = {"GPT_FINETUNE_STORAGE_ROOT": str(tmp_path / "unused")}
    for host in ssh_hosts:
        extra.update(host.connection_env())
    env = airflow_env(tmp_path / "home", free_port(), extra)
    conf = {**SSH_FAST, "backend": "ssh", "ssh_conn_ids": [h.conn_id for h in ssh_hosts]}
    # Hosts on network stacks of their own reach this machine at the bridge's address, not at its loopback.
    address = host_network.gateway if host_network else "127.0.0.1"
    result = subprocess.run([sys.executable, "scripts/demo.py", "--s3", "--s3-address", address,
                             "--conf", json.dumps(conf)],
                            cwd=REPO, env=env, capture_output=True, text=True, timeout=800, check=False)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-4000:]
    assert any(line.startswith("Report: s3://") for line in result.stdout.splitlines())
    assert "| distributed | 2 |" in result.stdout and "**Gates: PASSED**" in result.stdout
    assert f"[rank 1 host {ssh_hosts[1].address}]" in output
    assert_no_library_noise(output)  # paramiko's connection chatter included


def test_sigkill_of_the_train_task_runner_leaves_no_remote_worker(airflow_stack, ssh_hosts, connection_storage_run,
                                                                  tmp_path):
    """The task's own process killed outright (the OOM killer): the kernel closes its SSH connections, and each
    host's agent ends its worker within the orphan grace, also while the workers print nothing."""
    file = tmp_path / "connections.json"
    file.write_text(json.dumps(_connections(ssh_hosts)))
    airflow_stack.cli("connections", "import", str(file), "--overwrite")
    conf = {**connection_storage_run.conf, "max_steps": LONG["max_steps"], "backend": "ssh",
            "ssh_conn_ids": [h.conn_id for h in ssh_hosts]}
    run_id = trigger(airflow_stack, conf)
    key = run_key(DAG, run_id)
    wait_until(lambda: len(worker_ranks(key)) == 2, 400, "both trainer workers on their hosts")
    os.kill(task_runner_pid(airflow_stack, run_id, "train"), signal.SIGKILL)
    killed = time.monotonic()
    wait_until(lambda: not processes_of_run(key), 10, "every remote worker gone after SIGKILL of the task runner", 0.1)
    print(f"\nSIGKILL of train's task runner (ssh): every remote worker gone after {time.monotonic() - killed:.1f} s")

    airflow_stack.rest("PATCH", run_path(run_id), {"state": "failed"})  # the retry is not what this test is about
    assert airflow_stack.wait_for_run(DAG, run_id, timeout=300) == "failed"
    assert airflow_stack.task_states(DAG, run_id)["release"] == "success"
    assert processes_of_run(key) == {}
