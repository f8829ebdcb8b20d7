"""A real Airflow (API server, scheduler with LocalExecutor, DAG processor, triggerer) for tests.

Started as `make airflow` starts it (`scripts/airflow-env.sh` + `airflow standalone`, docs/running.md), but on a
temporary AIRFLOW_HOME and a free port, in its own process group so that every child is ended afterwards.
`AirflowClient` is how tests reach any such stack (REST, CLI, logs); tests/support/celery_stack.py builds the production
topology on it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from launcher.local import PortAllocator

REPO = Path(__file__).resolve().parents[2]


def free_port() -> int:
    return PortAllocator().allocate(1)[0]


@dataclass
class AirflowClient:
    """A running Airflow as tests reach it: REST with the SimpleAuthManager login, the CLI, the task log files."""

    home: Path
    port: int
    env: dict[str, str]

    @property
    def logs(self) -> Path:
        """Where the stack's own processes log (named in errors)."""
        raise NotImplementedError

    @property
    def url(self) -> str:
        return f"http://localhost:{self.port}"

    @property
    def login(self) -> tuple[str, str]:
        users = json.loads((self.home / "simple_auth_manager_passwords.json").read_text())
        return next(iter(users.items()))

    def cli(self, *args: str, timeout: float = 120, check: bool = True) -> subprocess.CompletedProcess:
        return subprocess.run(
            [str(REPO / ".venv" / "bin" / "airflow"), *args],
            env=self.env, capture_output=True, text=True, timeout=timeout, check=check, cwd=REPO,
        )

    def cli_json(self, *args: str, timeout: float = 120) -> list | dict:
        """A CLI command's `-o json` output (the last JSON line; log lines may come before it)."""
        out = self.cli(*args, "-o", "json", timeout=timeout).stdout
        return json.loads(next(line for line in reversed(out.splitlines()) if line.startswith(("[{", "[]", "{"))))

    def wait_for_dag(self, dag_id: str, timeout: float = 120) -> None:
        """Until the DAG processor has parsed `dag_id` (fails with the import errors otherwise).

        Polled through the REST API: an `airflow` CLI call costs seconds of CPU on 2 cores, taken from the runs
        under test."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                self.rest("GET", f"/api/v2/dags/{urllib.parse.quote(dag_id, safe='')}")
                return
            except urllib.error.HTTPError as error:
                if error.code != 404:
                    raise
            time.sleep(1)
        errors = self.cli("dags", "list-import-errors", check=False).stdout
        raise TimeoutError(f"{dag_id} was not parsed within {timeout}s; import errors:\n{errors}")

    def run_state(self, dag_id: str, run_id: str) -> str:
        dag, run = (urllib.parse.quote(part, safe="") for part in (dag_id, run_id))
        return self.rest("GET", f"/api/v2/dags/{dag}/dagRuns/{run}")["state"]

    def task_states(self, dag_id: str, run_id: str) -> dict[str, str]:
        dag, run = (urllib.parse.quote(part, safe="") for part in (dag_id, run_id))
        page = self.rest("GET", f"/api/v2/dags/{dag}/dagRuns/{run}/taskInstances?limit=100")
        assert page["total_entries"] == len(page["task_instances"]), "more task instances than one page"
        return {row["task_id"]: row["state"] for row in page["task_instances"]}

    def wait_for_run(self, dag_id: str, run_id: str, timeout: float) -> str:
        """The run's final state, polled every second through the REST API."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            state = self.run_state(dag_id, run_id)
            if state in ("success", "failed"):
                return state
            time.sleep(1)
        raise TimeoutError(f"run {run_id} of {dag_id} not finished after {timeout:.0f}s; logs: {self.logs}")

    def rest(self, method: str, path: str, body: dict | None = None) -> dict:
        """One call of the REST API with a token from the SimpleAuthManager login."""
        token = self._call("POST", "/auth/token", {"username": self.login[0], "password": self.login[1]}, {})
        return self._call(method, path, body, {"Authorization": f"Bearer {token['access_token']}"})

    def _call(self, method: str, path: str, body: dict | None, headers: dict[str, str]) -> dict:
        request = urllib.request.Request(f"{self.url}{path}", method=method,
                                         headers={"Content-Type": "application/json", **headers},
                                         data=json.dumps(body).encode() if body is not None else None)
        with urllib.request.urlopen(request, timeout=90) as response:  # an API server busy with a starting run
            return json.load(response)

    def task_log(self, dag_id: str, run_id: str, task_id: str, try_number: int = 1) -> str:
        folder = self.home / "logs" / f"dag_id={dag_id}" / f"run_id={run_id}" / f"task_id={task_id}"
        files = sorted(folder.glob(f"attempt={try_number}*"))
        return "\n".join(path.read_text(errors="replace") for path in files)


@dataclass
class AirflowStack(AirflowClient):
    """`airflow standalone` (scripts/standalone.sh): every component in one process group, one log."""

    process: subprocess.Popen
    log_path: Path

    @property
    def logs(self) -> Path:
        return self.log_path

    def stop(self) -> None:
        try:
            os.killpg(self.process.pid, signal.SIGTERM)
            self.process.wait(timeout=20)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            pass
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def airflow_env(home: Path, port: int, extra: dict[str, str] | None = None,
                overrides: dict[str, str] | None = None) -> dict[str, str]:
    """The environment `scripts/airflow-env.sh` sets, for a given home and port; `overrides` replace what it sets.

    No AIRFLOW_* or AWS_* variable of the test process leaks in: storage credentials reach a stack only as the
    tests give them (an Airflow connection, or `extra`)."""
    base = {k: v for k, v in os.environ.items() if not k.startswith(("AIRFLOW", "AWS_"))}
    base.update({"AIRFLOW_HOME": str(home), "AIRFLOW_PORT": str(port)})
    base.update(extra or {})
    out = subprocess.run(
        ["bash", "-c", "source scripts/airflow-env.sh && env -0"],
        env=base, cwd=REPO, capture_output=True, check=True,
    ).stdout
    return {**dict(item.split("=", 1) for item in out.decode().split("\0") if "=" in item), **(overrides or {})}


def start_stack(home: Path, extra_env: dict[str, str] | None = None, timeout: float = 400, *,
                port: int | None = None, overrides: dict[str, str] | None = None) -> AirflowStack:
    port = port or free_port()
    env = airflow_env(home, port, extra_env, overrides)
    log_path = home / "standalone.log"
    home.mkdir(parents=True, exist_ok=True)
    with open(log_path, "wb") as log_file:
        process = subprocess.Popen(
            ["bash", str(REPO / "scripts" / "standalone.sh")],
            env=env, cwd=REPO, stdout=log_file, stderr=subprocess.STDOUT, start_new_session=True,
        )
    stack = AirflowStack(home, port, env, process, log_path)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"airflow standalone exited with {process.returncode}; see {log_path}")
        try:
            with urllib.request.urlopen(f"{stack.url}/api/v2/monitor/health", timeout=5) as response:
                health = json.load(response)
            if all(health.get(part, {}).get("status") == "healthy" for part in ("scheduler", "dag_processor")):
                return stack
        except OSError:
            pass
        time.sleep(2)
    stack.stop()
    raise TimeoutError(f"Airflow did not become healthy within {timeout:.0f}s; see {log_path}")
