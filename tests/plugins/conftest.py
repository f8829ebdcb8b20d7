"""Helpers for the operator and launcher tests: tiny entry points, the process table, a local S3 server."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from tf_multiworker.launcher.process import live_group_members

from trainer.config.access import DATA_ROOTS_ENV, S3_BUCKETS_ENV, STORAGE_ROOT_ENV

ENTRYPOINTS = Path(__file__).resolve().parent / "entrypoints"
REPO = Path(__file__).resolve().parents[2]
HARNESS_DAGS = Path(__file__).resolve().parent / "harness_dags"
# The access policy's variables: the prepare task checked the config against them; no worker reads them.
ACCESS_POLICY_ENV = {DATA_ROOTS_ENV: "/srv/corpora", S3_BUCKETS_ENV: "corpora", STORAGE_ROOT_ENV: "s3://corpora/runs"}


def entrypoint_env(**extra: str) -> dict[str, str]:
    """Worker environment that makes the tiny entry points importable (workers run in a temp cwd)."""
    return {"PYTHONPATH": os.pathsep.join([str(ENTRYPOINTS), str(REPO)]), **extra}


_EXCEPTION_LINE = re.compile(r"^[\w.]+(Error|Exception): ", re.MULTILINE)


def failure_excerpt(task_log: str, limit: int = 6000) -> str:
    """What a run that should have passed prints: the task's exception with the launcher's whole message (each
    rank's cause and its last lines), which a plain tail cuts off when the log after it is long; else the tail."""
    failed = task_log.find("Task failed with exception")
    match = failed >= 0 and _EXCEPTION_LINE.search(task_log, failed)
    return task_log[match.start():match.start() + limit] if match else task_log[-limit:]


def alive(pid: int) -> bool:
    """Whether `pid` is a live (non-zombie) process."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] != "Z"


def wait_until_gone(pgids: list[int], timeout_s: float) -> list[int]:
    """Process groups that still have live (non-zombie) members after `timeout_s`; [] when all are gone."""
    deadline = time.monotonic() + timeout_s
    while True:
        alive = [pgid for pgid in pgids if live_group_members(pgid)]
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.05)


def start_launcher(tmp_path: Path, spec: dict, backend: str = "local", settings: dict | None = None,
                   timeout_s: float = 60) -> tuple[subprocess.Popen, list[dict]]:
    """A worker group launched by a process of its own (entrypoints/group_launcher.py), for a test to kill; returns
    the launcher and its workers' records once every rank has started."""
    case = tmp_path / "launcher-case.json"
    case.write_text(json.dumps({"spec": spec, "backend": backend, "settings": settings or {},
                                "workdir": str(tmp_path / "launcher-work")}))
    launcher = subprocess.Popen([sys.executable, str(ENTRYPOINTS / "group_launcher.py"), str(case)],
                                stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(REPO)})
    deadline = time.monotonic() + timeout_s
    for line in launcher.stdout:
        if line.startswith("LAUNCHED "):
            return launcher, json.loads(line.removeprefix("LAUNCHED "))["workers"]
        if time.monotonic() > deadline:
            break
    launcher.kill()
    raise AssertionError(f"the launcher did not start its group (exit {launcher.wait()})")


def guards_of(launcher_pid: int) -> list[int]:
    """Pids of the guard processes a launcher started (tf_multiworker.launcher.guard)."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            cmdline = (entry / "cmdline").read_bytes()
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError):
            continue
        if b"tf_multiworker.launcher.guard" in cmdline and ppid == launcher_pid:
            found.append(int(entry.name))
    return found


def wait_for(predicate, timeout_s: float, interval_s: float = 0.05) -> float:
    """Seconds until `predicate()` held; fails after `timeout_s`."""
    started = time.monotonic()
    while not predicate():
        if time.monotonic() - started > timeout_s:
            raise AssertionError(f"not within {timeout_s} s")
        time.sleep(interval_s)
    return time.monotonic() - started


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
        "PYTHONPATH": str(REPO),
    })
    subprocess.run([sys.executable, "-m", "airflow", "db", "migrate"], env=env, check=True, capture_output=True,
                   timeout=180)
    return env
