"""TFMultiWorkerOperator: run one entry point on N TensorFlow workers as a single Airflow task.

`__init__` only stores arguments; everything else happens in `execute`: the settings are coerced and checked, the
storage connection is read (lazily, through the hook), the group is launched and supervised by
`tf_multiworker.launcher`, and a run-state record is kept in object storage and XCom so the release task can end
anything left behind. Every worker line reaches the task log prefixed with its rank; the per-rank log files are
uploaded at the end, also when the group failed.

Airflow 3's task runner calls `on_kill` from its SIGTERM handler and then returns into `execute`
(apache/airflow#73006), so `execute` checks whether it was killed and raises: the task ends FAILED.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from functools import cached_property
from typing import Any

from airflow.sdk import BaseOperator
from airflow.sdk.exceptions import AirflowFailException

from tasks.launch import RecordedLaunch
from tasks.telemetry import LiveLineReader
from tf_multiworker.hook import StorageCredentialsHook
from tf_multiworker.launcher import (
    GroupSpec,
    GroupState,
    LaunchError,
    RunResult,
    WorkerGroupStoppedError,
    error_for,
)
from tf_multiworker.launcher.errors import MissingOutputError
from tf_multiworker.registry import UnknownBackendError, make_backend
from trainer.layout import StorageLayout, absolute_root
from trainer.metrics import LIVE_INTERVAL_ENV
from trainer.storage import exists

STATE_XCOM_KEY = "worker_state"
# Airflow's supervisor SIGKILLs the task process 5 s after its SIGTERM; workers live in their own sessions and
# would outlive it, so a kill gives them at most this long before SIGKILL. (Workers end on SIGTERM, at once or after
# the checkpoint they are writing: the trainer undoes TensorFlow's preemption handler, trainer/runtime.py.)
ON_KILL_GRACE_S = 3.0
# Seconds between two live metrics lines of a rank (when Airflow's metrics are on): a gauge keeps its last value,
# and StatsD exporters and Prometheus scrapes look every 10-15 s.
LIVE_INTERVAL_S = 2.0
_TRUE = {"true", "1", "yes", "on"}
_FALSE = {"false", "0", "no", "off", ""}


def _as_bool(name: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in _TRUE | _FALSE:
        return value.strip().lower() in _TRUE
    raise ValueError(f"{name} must be true or false, got {value!r}")


def _as_number(name: str, value: Any, kind: type, minimum: float) -> Any:
    if isinstance(value, bool):
        raise TypeError(f"{name} must be a number, got {value!r}")
    try:
        number = kind(float(value)) if kind is float else int(str(value).strip())
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be {'an integer' if kind is int else 'a number'}, got {value!r}") from None
    if number < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value!r}")
    return number


def _as_str(name: str, value: Any) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value)
    raise TypeError(f"{name} must be a string, got {type(value).__name__} {value!r}")


class TFMultiWorkerOperator(BaseOperator):
    """Launch `python -m <entrypoint> <args>` on `num_workers` workers with per-rank TF_CONFIG; fail as one.

    :param entrypoint: module run on every worker (`python -m`), e.g. `trainer.train`.
    :param args: its arguments (templated).
    :param num_workers: workers; one GPU each when `use_gpu` (templated; numeric strings accepted).
    :param backend: where workers run (`tf_multiworker.registry`): `local` starts processes on this Airflow
        worker, `ssh` on the hosts of `backend_settings["ssh_conn_ids"]`, `kubernetes` one pod per rank.
    :param backend_settings: the run's settings the backend reads (a `RunConfig.to_dict()`; templated).
    :param use_gpu: pin one free GPU per worker (NVML), refuse when too few; else `CUDA_VISIBLE_DEVICES=""`.
    :param storage_root: root URL of the run's storage (state record, logs).
    :param run_key: the run's key under `storage_root/runs/`.
    :param storage_conn_id: Airflow connection with S3 credentials, handed to workers as environment only.
    :param startup_timeout_s: time for every rank to signal that it joined the group.
    :param hang_timeout_s: end a group that printed nothing for this long once all ranks joined.
    :param summary_url: the chief's `summary.json`; when set it must exist after the workers succeed.
    :param env: extra environment variables for every worker (shown in the log: put no secrets here).
    :param grace_period_s: SIGTERM -> SIGKILL delay when stopping the group after a failure (a kill of the task
        waits at most ON_KILL_GRACE_S).
    :param max_launch_attempts: relaunches on new ports after a port-bind failure, at most this many attempts.
    """

    template_fields: Sequence[str] = (
        "args", "num_workers", "backend", "backend_settings", "use_gpu", "storage_root", "run_key", "storage_conn_id",
        "startup_timeout_s", "hang_timeout_s", "summary_url", "env", "grace_period_s", "max_launch_attempts",
    )
    ui_color = "#ffd8b1"

    def __init__(
        self,
        *,
        entrypoint: str,
        storage_root: str,
        run_key: str,
        args: Sequence[Any] = (),
        num_workers: int | str = 1,
        backend: str = "local",
        backend_settings: dict[str, Any] | str | None = None,
        use_gpu: bool | str = False,
        storage_conn_id: str = "",
        startup_timeout_s: float | str = 180,
        hang_timeout_s: float | str = 600,
        summary_url: str | None = None,
        env: dict[str, Any] | None = None,
        grace_period_s: float | str = 10,
        max_launch_attempts: int | str = 3,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.entrypoint = entrypoint
        self.args = args
        self.num_workers = num_workers
        self.backend = backend
        self.backend_settings = backend_settings
        self.use_gpu = use_gpu
        self.storage_root = storage_root
        self.run_key = run_key
        self.storage_conn_id = storage_conn_id
        self.startup_timeout_s = startup_timeout_s
        self.hang_timeout_s = hang_timeout_s
        self.summary_url = summary_url
        self.env = env
        self.grace_period_s = grace_period_s
        self.max_launch_attempts = max_launch_attempts
        self.group: RecordedLaunch | None = None  # must be set for on_kill
        self._killed = False
        self._live_metrics: LiveLineReader | None = None

    @cached_property
    def hook(self) -> StorageCredentialsHook:
        return StorageCredentialsHook(self.storage_conn_id or "")

    # -- Airflow entry points ---------------------------------------------------------------------------------

    def execute(self, context: Any) -> dict[str, Any]:
        self._refuse_a_run_that_is_over(context["ti"])
        spec = self._group_spec()
        run = StorageLayout(absolute_root(_as_str("storage_root", self.storage_root))).run(
            _as_str("run_key", self.run_key))
        if self.backend_settings is not None and not isinstance(self.backend_settings, dict):
            raise TypeError(f"backend_settings must be a mapping, got {self.backend_settings!r}")
        try:
            backend = make_backend(_as_str("backend", self.backend), self.backend_settings)
        except UnknownBackendError as error:
            raise LaunchError(str(error)) from None
        try:
            spec = self.plan_group(context, spec, backend)
        except BaseException:
            backend.close()
            raise
        self._live_metrics = LiveLineReader(run=spec.run_key, task=self.task_id)
        if self._live_metrics.enabled:  # per-step lines only when Airflow sends metrics somewhere
            spec = dataclasses.replace(spec, env={**spec.env, LIVE_INTERVAL_ENV: str(LIVE_INTERVAL_S)})
        ti = context["ti"]
        try:
            self.group = RecordedLaunch(spec, backend, run, on_line=self._log_worker_line, storage=self.hook.applied,
                                        on_record=lambda record: ti.xcom_push(key=STATE_XCOM_KEY, value=record))
            result = self.group.run_group(stopped=lambda: self._killed)
        finally:
            backend.close()
        if self._killed or result.state is GroupState.STOPPED:
            raise WorkerGroupStoppedError(result)
        if not result.succeeded:
            raise error_for(result)
        if self.summary_url:
            with self.hook.applied():
                if not exists(self.summary_url):
                    raise MissingOutputError(
                        f"all {spec.num_workers} workers of {self.task_id} exited 0 but the chief wrote no summary at "
                        f"{self.summary_url}: the job did not complete (see logs at {run.logs(self.task_id)})")
        return self._summary(result, run)

    def on_kill(self) -> None:
        self._killed = True
        if self.group is not None:
            grace_s = min(_as_number("grace_period_s", self.grace_period_s, float, 0.1), ON_KILL_GRACE_S)
            self.group.stop(f"task {self.task_id} was killed (SIGTERM, marked failed or execution_timeout)", grace_s)

    def _refuse_a_run_that_is_over(self, ti: Any) -> None:
        """Airflow can start a retry in a run that is already over: when the run is marked failed while the scheduler
        handles the death of the task's previous attempt, that attempt still becomes up_for_retry, and the retry runs
        (seen with train's task runner SIGKILLed and the run marked failed 0.15 s later). Its workers would start after
        release has checked the hosts, and nothing would end them."""
        state = ti.get_dagrun_state(dag_id=ti.dag_id, run_id=ti.run_id)
        if state in ("failed", "success"):
            raise AirflowFailException(
                f"{self.task_id} launches no workers: DAG run {ti.run_id} is already {state} (marked from outside "
                f"while an earlier attempt of {self.task_id} ended). Trigger a new run, or clear the run's tasks, to "
                f"train again.")

    def plan_group(self, context: Any, spec: GroupSpec, backend: Any) -> GroupSpec:
        """The group to launch now; subclasses may shrink it to what the backend can place
        (`tf_multiworker.elastic.ElasticTrainOperator`). Runs after the backend exists, before anything starts."""
        return spec

    # -- helpers ----------------------------------------------------------------------------------------------

    def _group_spec(self) -> GroupSpec:
        """The rendered arguments as checked launch settings: fail before anything starts."""
        if isinstance(self.args, (str, bytes)) or not isinstance(self.args, (list, tuple)):
            raise TypeError(f"args must be a list, got {self.args!r}")
        if self.env is not None and not isinstance(self.env, dict):
            raise TypeError(f"env must be a mapping of variable names to values, got {self.env!r}")
        return GroupSpec(
            name=self.task_id,
            entrypoint=self.entrypoint,
            args=tuple(_as_str(f"args[{i}]", a) for i, a in enumerate(self.args)),
            num_workers=_as_number("num_workers", self.num_workers, int, 1),
            use_gpu=_as_bool("use_gpu", self.use_gpu),
            env={k: _as_str(f"env[{k}]", v) for k, v in (self.env or {}).items()},
            # The run key marks every worker of the run, so release finds even those no record names.
            run_key=_as_str("run_key", self.run_key),
            secret_env=self.hook.env,
            startup_timeout_s=_as_number("startup_timeout_s", self.startup_timeout_s, float, 1),
            hang_timeout_s=_as_number("hang_timeout_s", self.hang_timeout_s, float, 1),
            grace_period_s=_as_number("grace_period_s", self.grace_period_s, float, 0.1),
            max_launch_attempts=_as_number("max_launch_attempts", self.max_launch_attempts, int, 1),
        )

    def _log_worker_line(self, rank: int, line: str) -> None:
        if self._live_metrics is not None and self._live_metrics.consume(rank, line):
            return  # a metrics line: to Airflow's metrics, not the task log (the rank's log file keeps it)
        self.log.info("[%s] %s", self.group.label(rank) if self.group else f"rank {rank}", line)

    def _summary(self, result: RunResult, run: Any) -> dict[str, Any]:
        return {
            "task_id": self.task_id,
            "state": result.state.value,
            "num_workers": len(result.workers),
            "wall_time_s": round(result.wall_time_s, 3),
            "launch_attempts": result.attempts,
            "workers": [{"rank": w.rank, "host": w.host, "exit_code": w.exit_code, "state": w.state.value}
                        for w in result.workers],
            "summary_url": self.summary_url,
            "state_url": run.state_file(self.task_id),
            "logs_url": run.logs(self.task_id),
        }
