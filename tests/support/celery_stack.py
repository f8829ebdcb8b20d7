"""A production-like Airflow for tests: Postgres, Redis and the CeleryExecutor, every component its own process.

What the official docker-compose and Helm chart run, on one machine: a throwaway Postgres cluster and a redis-server
on free ports, `airflow db migrate`, then the API server, scheduler, DAG processor, triggerer and two Celery workers
(queues `default` and `gpu`). Each component runs in its own session with its own log, so that a test can signal,
kill or restart one of them. All get scripts/airflow-env.sh's environment (`airflow_env`) with the executor, the
database and the broker replaced, and every port a free one: the stack runs beside a standalone stack of another
pytest-xdist worker.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import pwd
import secrets
import shlex
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

import psutil

from tests.support.airflow_stack import REPO, AirflowClient, airflow_env, free_port

AIRFLOW = str(REPO / ".venv" / "bin" / "airflow")
QUEUES = ("default", "gpu")
GPU_POOL_SLOTS = 4
STOP_GRACE_S = 5.0  # Celery's warm shutdown waits for running tasks: a stop does not wait for them
LOG_TAIL_LINES = 40
# Components whose health /api/v2/monitor/health reports (the key there), from their jobs' heartbeats.
HEARTBEAT_KEYS = {"scheduler": "scheduler", "dag-processor": "dag_processor", "triggerer": "triggerer"}
WORKER_NAME_ENV = "CELERY_STACK_WORKER_NAME"
INSTALL_HINT = "run `make provision` as root, or `apt-get install -y postgresql redis-server`"


def celery_node_name() -> str:
    """The workers' `[core] hostname_callable`: a task instance's `hostname` is the Celery node that ran it.

    By default Airflow stores the host's FQDN there, the same for both workers of this one machine, whereas each
    worker of a real deployment has a host of its own."""
    return os.environ[WORKER_NAME_ENV]


def postgres_tool(name: str) -> Path | None:
    """A PostgreSQL server binary: Debian keeps them off PATH, under /usr/lib/postgresql/<version>/bin."""
    versions = sorted(Path("/usr/lib/postgresql").glob(f"*/bin/{name}"), key=lambda path: int(path.parts[-3]))
    found = versions[-1] if versions else shutil.which(name)
    return Path(found) if found else None


def unavailable_reason() -> str | None:
    """Why the Celery stack cannot start here, or None."""
    missing = [what for what, found in (("PostgreSQL", postgres_tool("initdb")),
                                        ("redis-server", shutil.which("redis-server"))) if not found]
    if missing:
        return f"{' and '.join(missing)} not installed, needed by the Celery stack: {INSTALL_HINT}"
    if os.getuid() == 0:
        try:
            pwd.getpwnam("postgres")
        except KeyError:
            return f"initdb refuses to run as root and there is no `postgres` user to run it as: {INSTALL_HINT}"
    try:
        importlib.metadata.version("apache-airflow-providers-celery")
    except importlib.metadata.PackageNotFoundError:
        return "apache-airflow-providers-celery is not in .venv: run `make setup` (uv sync --frozen)"
    return None


class ComponentStartError(RuntimeError):
    def __init__(self, name: str, problem: str, command: list[str], log_path: Path, output: str):
        tail = "\n".join(output.splitlines()[-LOG_TAIL_LINES:])
        super().__init__(f"{name} {problem}. Fix what its log says (its settings: tests/support/celery_stack.py and "
                         f"the test's overrides).\ncommand: {shlex.join(command)}\nlast {LOG_TAIL_LINES} lines of "
                         f"{log_path}:\n{tail}")


def end_process_groups(processes: list[subprocess.Popen], grace_s: float = STOP_GRACE_S) -> None:
    """TERM each process's group, KILL it after `grace_s`, and KILL the groups its descendants made their own
    (a task runner, an operator's workers), which would otherwise outlive it. A group outlives its leader (a
    component killed by a test): it is signalled all the same."""
    groups = {process.pid for process in processes} | _descendant_groups(processes)
    groups.discard(os.getpgrp())
    for process in processes:
        _killpg(process.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for process in processes:
        try:
            process.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
    for group in groups:
        _killpg(group, signal.SIGKILL)
    for process in processes:
        process.wait(timeout=10)


def _descendant_groups(processes: list[subprocess.Popen]) -> set[int]:
    """The process groups of every live descendant of `processes`."""
    groups = set()
    for process in processes:
        if process.poll() is not None:  # reaped: its pid may be another process's now
            continue
        try:
            descendants = psutil.Process(process.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            continue
        for child in descendants:
            try:
                groups.add(os.getpgid(child.pid))
            except ProcessLookupError:
                pass
    return groups


def _killpg(group: int, sig: int) -> None:
    try:
        os.killpg(group, sig)
    except ProcessLookupError:
        pass


@dataclass
class Component:
    """One process of the stack, in a session of its own; its log is appended to by every (re)start."""

    name: str
    command: list[str]
    env: dict[str, str]
    log_path: Path
    is_ready: Callable[[Component], bool]
    process: subprocess.Popen | None = None
    started_at: float = 0.0  # time.time() of the last start: a heartbeat older than that is a previous process's
    log_offset: int = 0  # where the last start's output begins in the log
    ready_s: float | None = None

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            self.log_offset, self.started_at, self.ready_s = log.tell(), time.time(), None
            self.process = subprocess.Popen(self.command, env=self.env, cwd=REPO, stdout=log,
                                            stderr=subprocess.STDOUT, start_new_session=True)

    def output(self) -> str:
        """The log since the last start."""
        with open(self.log_path, "rb") as log:
            log.seek(self.log_offset)
            return log.read().decode(errors="replace")

    def start_error(self, problem: str) -> ComponentStartError:
        return ComponentStartError(self.name, problem, self.command, self.log_path, self.output())


def wait_until_ready(components: list[Component], timeout: float) -> None:
    """Until every component is ready; a component that exits first, or is not ready in time, raises its error."""
    pending, deadline = list(components), time.monotonic() + timeout
    while True:
        for component in list(pending):
            if component.process.poll() is not None:
                raise component.start_error(f"exited with {component.process.returncode} during start-up")
            if component.is_ready(component):
                component.ready_s = time.time() - component.started_at
                pending.remove(component)
        if not pending:
            return
        if time.monotonic() > deadline:
            others = f" (nor {', '.join(c.name for c in pending[1:])})" if pending[1:] else ""
            raise pending[0].start_error(f"was not ready within {timeout:.0f}s{others}")
        time.sleep(1)


@dataclass
class Postgres:
    """A throwaway cluster in a temporary directory (data, socket, server log), removed by `stop`."""

    root: Path
    port: int

    @property
    def url(self) -> str:
        return f"postgresql+psycopg2://airflow:airflow@127.0.0.1:{self.port}/airflow"

    @classmethod
    def start(cls) -> Postgres:
        # Not under pytest's tmp_path: its parents are private to root, and initdb refuses to run as root.
        cluster = cls(Path(tempfile.mkdtemp(prefix="celery-stack-pg-")), free_port())
        try:
            if os.getuid() == 0:
                shutil.chown(cluster.root, "postgres", "postgres")
            data = str(cluster.root / "data")
            cluster._run("initdb", "-D", data, "-A", "trust", "-U", "postgres", "-E", "UTF8", "--no-sync")
            server = f"-p {cluster.port} -k {cluster.root} -c listen_addresses=127.0.0.1 -c fsync=off"
            cluster._run("pg_ctl", "-D", data, "-l", str(cluster.log_path), "-o", server, "-w", "-t", "60", "start")
            cluster._run("psql", "-h", str(cluster.root), "-p", str(cluster.port), "-U", "postgres",
                         "-v", "ON_ERROR_STOP=1", "-c", "CREATE ROLE airflow LOGIN PASSWORD 'airflow'",
                         "-c", "CREATE DATABASE airflow OWNER airflow")
        except BaseException:
            cluster.stop()
            raise
        return cluster

    @property
    def log_path(self) -> Path:
        return self.root / "server.log"

    def _run(self, tool: str, *args: str, check: bool = True) -> None:
        command = [str(postgres_tool(tool)), *args]
        if os.getuid() == 0:
            command = ["runuser", "-u", "postgres", "--", *command]
        result = subprocess.run(command, capture_output=True, text=True, timeout=120, start_new_session=True,
                                cwd=self.root, check=False)
        if check and result.returncode:
            server_log = self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
            raise ComponentStartError(f"postgres ({tool})", f"exited with {result.returncode}", command,
                                      self.log_path, result.stdout + result.stderr + server_log)

    def stop(self) -> None:
        pid_file = self.root / "data" / "postmaster.pid"
        if pid_file.exists():
            self._run("pg_ctl", "-D", str(pid_file.parent), "-m", "immediate", "-w", "stop", check=False)
        if pid_file.exists():  # pg_ctl could not stop it
            try:
                os.kill(int(pid_file.read_text().split()[0]), signal.SIGKILL)
            except (ProcessLookupError, ValueError, IndexError):
                pass
        shutil.rmtree(self.root, ignore_errors=True)


@dataclass
class CeleryStack(AirflowClient):
    """What `start_celery_stack` started; `components` by name: redis, api-server, scheduler, dag-processor,
    triggerer, worker-default, worker-gpu."""

    components: dict[str, Component] = field(default_factory=dict)
    postgres: Postgres | None = None
    startup_s: float = 0.0
    step_s: dict[str, float] = field(default_factory=dict)  # Postgres and the migration, before the components

    @property
    def logs(self) -> Path:
        return self.home / "stack_logs"

    @property
    def component_s(self) -> dict[str, float]:
        """Seconds from each component's last start until it was seen ready (the scheduler, DAG processor and
        triggerer are seen through the API server's health report, so not before the API server)."""
        return {name: component.ready_s for name, component in self.components.items()}

    def startup_report(self) -> str:
        steps = ", ".join(f"{name} {seconds:.1f}s" for name, seconds in self.step_s.items())
        ready = ", ".join(f"{name} {seconds:.1f}s" for name, seconds in self.component_s.items())
        return (f"Celery stack ready in {self.startup_s:.1f}s: {steps}; components from their start "
                f"(redis first, the others in parallel after the migration): {ready}")

    def worker_hostname(self, queue: str) -> str:
        """A task instance's `hostname` when the worker of `queue` ran it (see `celery_node_name`)."""
        return self.components[f"worker-{queue}"].env[WORKER_NAME_ENV]

    def kill_component(self, name: str, sig: int = signal.SIGKILL) -> None:
        os.killpg(self.components[name].process.pid, sig)

    def restart_component(self, name: str, timeout: float = 180) -> float:
        """Stop a component's group, start it again as before, wait until it is ready; returns the seconds."""
        component = self.components[name]
        end_process_groups([component.process])
        component.start()
        wait_until_ready([component], timeout)
        return component.ready_s

    def stop(self) -> None:
        end_process_groups([c.process for c in reversed(self.components.values()) if c.process is not None])
        if self.postgres is not None:
            self.postgres.stop()

    def _add(self, name: str, command: list[str], is_ready: Callable[[Component], bool],
             env: dict[str, str] | None = None) -> Component:
        component = Component(name, command, env or self.env, self.logs / f"{name}.log", is_ready)
        self.components[name] = component
        return component

    def _health(self) -> dict | None:
        try:
            with urllib.request.urlopen(f"{self.url}/api/v2/monitor/health", timeout=5) as response:
                return json.load(response)
        except OSError:
            return None

    def _api_answers(self, _component: Component) -> bool:
        return self._health() is not None

    def _heartbeat_after_start(self, component: Component) -> bool:
        key = HEARTBEAT_KEYS[component.name]
        report = (self._health() or {}).get(key) or {}
        beat = report.get(f"latest_{key}_heartbeat")
        return report.get("status") == "healthy" and beat is not None and (
            datetime.fromisoformat(beat).timestamp() >= component.started_at)


def _logged(line: str) -> Callable[[Component], bool]:
    return lambda component: line in component.output()


def stack_env(home: Path, port: int, postgres: Postgres, redis_port: int,
              extra_env: dict[str, str] | None) -> dict[str, str]:
    """scripts/airflow-env.sh's environment with the production settings every component shares."""
    from cryptography.fernet import Fernet

    settings = {
        "AIRFLOW__CORE__EXECUTOR": "CeleryExecutor",
        "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": postgres.url,
        "AIRFLOW__CELERY__BROKER_URL": f"redis://127.0.0.1:{redis_port}/0",
        "AIRFLOW__CELERY__RESULT_BACKEND": f"db+{postgres.url}",
        # Redis hands a task unacknowledged this long to another worker, and the copy ends the original: longer
        # than any test's task (the provider's default is 24 h, with a warning).
        "AIRFLOW__CELERY_BROKER_TRANSPORT_OPTIONS__VISIBILITY_TIMEOUT": "7200",
        "AIRFLOW__API__WORKERS": "1",
        # A restarted scheduler adopts its predecessor's tasks at the first orphan check after that one's heartbeat
        # is older than scheduler_health_check_threshold (30 s, kept: a loaded scheduler that missed it would adopt
        # its own tasks); the default check interval, 300 s, would leave a task that failed meanwhile running.
        "AIRFLOW__SCHEDULER__ORPHANED_TASKS_CHECK_INTERVAL": "10",
        # One per stack, shared: the scheduler signs the tasks' tokens and the API server checks them.
        "AIRFLOW__API_AUTH__JWT_SECRET": secrets.token_urlsafe(64),  # 64 bytes at least: PyJWT warns below
        "AIRFLOW__API__SECRET_KEY": secrets.token_urlsafe(32),
        "AIRFLOW__CORE__FERNET_KEY": Fernet.generate_key().decode(),
        # The defaults (8793, 8794, 8974) belong to whichever stack took them first on this machine.
        "AIRFLOW__LOGGING__WORKER_LOG_SERVER_PORT": str(free_port()),
        "AIRFLOW__LOGGING__TRIGGER_LOG_SERVER_PORT": str(free_port()),
        "AIRFLOW__SCHEDULER__SCHEDULER_HEALTH_CHECK_SERVER_PORT": str(free_port()),
    }
    return airflow_env(home, port, extra_env, settings)


def start_celery_stack(home: Path, extra_env: dict[str, str] | None = None, timeout: float = 300, *,
                       gpu_slots: int = GPU_POOL_SLOTS) -> CeleryStack:
    """Start the whole stack on `home` (its logs in `home/stack_logs`), the repo's DAGs and `extra_env` (see
    `airflow_env`) for every component. Stopped again if any part fails."""
    reason = unavailable_reason()
    if reason:
        raise RuntimeError(reason)
    began, deadline = time.time(), time.monotonic() + timeout
    home.mkdir(parents=True, exist_ok=True)
    stack = CeleryStack(home, free_port(), {})
    try:
        redis_port = free_port()
        stack._add("redis", ["redis-server", "--bind", "127.0.0.1", "--port", str(redis_port), "--save", "",
                             "--appendonly", "no", "--dir", str(home)],
                   _logged("Ready to accept connections"), env=dict(os.environ)).start()
        wait_until_ready([stack.components["redis"]], timeout=30)
        postgres_began = time.time()
        stack.postgres = Postgres.start()
        stack.step_s["postgres"] = time.time() - postgres_began
        stack.env = stack_env(home, stack.port, stack.postgres, redis_port, extra_env)

        migrate = Component("db-migrate", [AIRFLOW, "db", "migrate"], stack.env, stack.logs / "db-migrate.log",
                            lambda _: False)
        migrate.start()
        try:
            returncode = migrate.process.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            end_process_groups([migrate.process])
            raise migrate.start_error(f"did not finish within {timeout:.0f}s") from None
        if returncode:
            raise migrate.start_error(f"exited with {returncode}")
        stack.step_s["db migrate"] = time.time() - migrate.started_at

        stack._add("api-server", [AIRFLOW, "api-server"], stack._api_answers)
        for name in HEARTBEAT_KEYS:
            stack._add(name, [AIRFLOW, name], stack._heartbeat_after_start)
        for queue in QUEUES:
            node = f"{queue}@{socket.gethostname()}"
            env = {**stack.env, WORKER_NAME_ENV: node,
                   "AIRFLOW__CORE__HOSTNAME_CALLABLE": f"{__name__}.celery_node_name"}
            if queue != QUEUES[0]:  # each worker serves its task logs on a port of its own
                env["AIRFLOW__LOGGING__WORKER_LOG_SERVER_PORT"] = str(free_port())
            stack._add(f"worker-{queue}", [AIRFLOW, "celery", "worker", "-q", queue, "-c", "1", "-H", node],
                       _logged(f"{node} ready."), env=env)
        starting = [component for component in stack.components.values() if component.process is None]
        for component in starting:
            component.start()
        wait_until_ready(starting, max(1.0, deadline - time.monotonic()))

        from tf_multiworker.gpu_admission import GPU_POOL, POOL_DESCRIPTION

        stack.rest("POST", "/api/v2/pools", {"name": GPU_POOL, "slots": gpu_slots, "description": POOL_DESCRIPTION,
                                             "include_deferred": False})
    except BaseException:
        stack.stop()
        raise
    stack.startup_s = time.time() - began
    print(stack.startup_report())
    return stack
