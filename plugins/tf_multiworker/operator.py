"""TFMultiWorkerOperator: run one entry point on N TensorFlow workers as a single Airflow task.

`__init__` only stores arguments; everything else happens in `execute`: the run's prepared configuration, loaded
once as a `RunConfig` (from the one prepared XCom, held to the access policy here), gives the backend, the worker
count, GPU use, timeouts, storage root and connection,
the storage connection is read (lazily, through the hook), the group is launched and supervised by
`launcher`, and a run-state record is kept in object storage and XCom so the release task can end
anything left behind. Every worker line reaches the task log prefixed with its rank; the per-rank log files are
uploaded at the end, also when the group failed.

Airflow 3's task runner calls `on_kill` from its SIGTERM handler and then returns into `execute`
(apache/airflow#73006), so `execute` checks whether it was killed and raises: the task ends FAILED.

What a failed group's exit statuses say decides what Airflow does next (core/protocol.py): a rank that exited
EXIT_PERMANENT (a refused setting, bad data, a diverged loss) fails the task at once with `AirflowFailException`,
whatever its retries; a group whose failed ranks all exited EXIT_PREEMPTED (each saved the checkpoint the next attempt
resumes from) is rescheduled with `AirflowRescheduleException`, which Airflow 3.3 runs again without counting a try
(models/dagrun.py keeps `try_number` for UP_FOR_RESCHEDULE), up to `preemption_reschedules` times; anything else
raises the group's error and uses the task's retries. A group stopped because it held its slots idle for
`reclaim_idle_after_s` fails the task with `IdleReclaimedError`, an `AirflowFailException`: no retry.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime, timedelta
from functools import cached_property
from typing import Any

from airflow.sdk import BaseOperator
from airflow.sdk.exceptions import AirflowFailException, AirflowRescheduleException

from core.config import ConfigError, RunConfig
from core.config.access import AccessPolicy
from core.config.pinned import config_bytes
from core.layout import StorageLayout, TrainOutput, absolute_root
from core.layout import run_key as layout_run_key
from core.protocol import CONFIG_SHA256_ENV, EXIT_PERMANENT, EXIT_PREEMPTED, MANIFEST_SHA256_ENV
from core.storage import exists
from launcher import (
    GroupSpec,
    GroupState,
    LaunchError,
    RunResult,
    WorkerFailedError,
    WorkerGroupStoppedError,
    error_for,
)
from launcher.errors import MissingOutputError
from tasks.launch import IdleSettings, RecordedLaunch
from tasks.policy import check_launch_urls
from tasks.telemetry import LiveLineReader
from tf_multiworker.backends import UnknownBackendError, make_backend
from tf_multiworker.hook import StorageCredentialsHook
from trainer.metrics import LIVE_INTERVAL_ENV

STATE_XCOM_KEY = "worker_state"
# Airflow's supervisor SIGKILLs the task process 5 s after its SIGTERM; workers live in their own sessions and
# would outlive it, so a kill gives them at most this long before SIGKILL. (Workers end on SIGTERM, at once or after
# the checkpoint they are writing: the trainer undoes TensorFlow's preemption handler, trainer/runtime.py.)
ON_KILL_GRACE_S = 3.0
# Seconds between two live metrics lines of a rank (when Airflow's metrics are on): a gauge keeps its last value,
# and StatsD exporters and Prometheus scrapes look every 10-15 s.
LIVE_INTERVAL_S = 2.0
# A preemption checkpoint must be written before the stop ladder's SIGKILL: the group's grace period (and a pod's
# terminationGracePeriodSeconds, which the Kubernetes backend sets from it) is at least the deadline plus this.
PREEMPTION_MARGIN_S = 2.0


class NotRetryableError(WorkerFailedError, AirflowFailException):
    """A rank exited EXIT_PERMANENT: a refused setting, bad data or a diverged loss, which no retry can fix. Airflow
    fails the task without retrying (an AirflowFailException); `result` names the rank and its error, like any
    worker failure."""

    def __init__(self, result: RunResult) -> None:
        super().__init__(result)
        note = (f"A rank exited {EXIT_PERMANENT}: a retry cannot fix this (a refused setting, bad data or a diverged "
                "loss), so the task fails now without spending its retries.")
        self.args = (f"{result.error_message()}\n{note}",)


class IdleReclaimedError(WorkerGroupStoppedError, AirflowFailException):
    """The group was stopped because it held its slots idle for `reclaim_idle_after_s` (tasks/launch.py): a retry
    would hold them the same way, so the task fails without one. Its message is the reclaim's text."""

    def __init__(self, result: RunResult, reclaim_text: str) -> None:
        super().__init__(result)
        note = ("The group's slots were reclaimed: the task fails without spending its retries (the next run "
                "resumes from the last checkpoint in its output).")
        self.args = (f"{reclaim_text}\n{note}",)


class TFMultiWorkerOperator(BaseOperator):
    """Launch `python -m <entrypoint> <args>` on the run's workers with per-rank TF_CONFIG; fail as one.

    :param entrypoint: module run on every worker (`python -m`), e.g. `trainer.train`.
    :param run_config: the run's prepared configuration (`RunConfig.to_dict()`, the prepare stage's XCom;
        templated), loaded once (`config`). It names the backend (`local` processes on this Airflow worker, `ssh`
        hosts, `kubernetes` pods: `tf_multiworker.backends`), `num_workers`, `use_gpu` (one free GPU per worker,
        NVML; else `CUDA_VISIBLE_DEVICES=""`), the timeouts, `storage_root` and `storage_conn_id` (S3 credentials
        handed to workers as environment only).
    :param config_url: the config file the workers load, passed as `--config` (templated; unset: none).
    :param output_url: where the workers write, passed as `--output` (templated; unset: none).
    :param run_key: the run's key under `storage_root/runs/`; unset (the DAG's way): derived from the task's
        (dag_id, run_id) here, never read from XCom, where an editor could name another run's key and the sweep of
        earlier attempts would end that run's workers.
    :param args: the entry point's other arguments (templated). The argv's storage URLs (`--config`, `--manifest`,
        `--output`, `--model`, `--baseline-summary`) must lie in the run's own storage layout
        (`tasks.policy.check_launch_urls`).
    :param manifest_sha256: the sha256 the prepared run's XCom pinned for the dataset manifest the argv's
        `--manifest` names (templated); every worker gets it as `MANIFEST_SHA256_ENV` and refuses a manifest of
        another digest (trainer/data.py). Required with `--manifest`.
    :param num_workers: launch this many workers instead of the configuration's (the one-worker baseline).
    :param summary_url: the chief's `summary.json`, the one of `output_url`; when set it must exist after the
        workers succeed.

    The `--config` file is the run's config.json or baseline_config.json: every worker gets the sha256 of the
    bytes this operator checked (`config_bytes` of `run_config`, or of its baseline configuration) as
    `CONFIG_SHA256_ENV` and refuses a file of another digest (core/config/pinned.py).
    :param env: extra environment variables for every worker (shown in the log: put no secrets here).
    :param grace_period_s: SIGTERM -> SIGKILL delay when stopping the group after a failure (a kill of the task
        waits at most ON_KILL_GRACE_S).
    :param max_launch_attempts: relaunches on new ports after a port-bind failure, at most this many attempts.
    :param preemption_reschedules: a group whose ranks exited on a preemption notice (checkpoint saved) is run again
        through Airflow's reschedule, which spends no retry, at most this many times per try; then it fails as usual.
    :param preemption_reschedule_delay_s: how long after the preemption the rescheduled run may start.
    """

    # num_workers is never a template: listed so that the scheduler's copy of the task has it (GPU admission).
    template_fields: Sequence[str] = ("args", "run_config", "config_url", "output_url", "run_key", "summary_url",
                                      "env", "manifest_sha256", "num_workers")
    ui_color = "#ffd8b1"

    # An operator takes its arguments as keywords, each its own field: Airflow renders template_fields by name, the
    # DAG's serialization stores each field, and default_args fill any of them; a record would hide them all.
    def __init__(  # noqa: PLR0913
        self,
        *,
        entrypoint: str,
        run_config: dict[str, Any] | str,
        config_url: str | None = None,
        output_url: str | None = None,
        run_key: str | None = None,
        args: Sequence[Any] = (),
        num_workers: int | None = None,
        summary_url: str | None = None,
        env: dict[str, Any] | None = None,
        grace_period_s: float = 10.0,
        max_launch_attempts: int = 3,
        preemption_reschedules: int = 3,
        preemption_reschedule_delay_s: float = 10.0,
        manifest_sha256: str | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.entrypoint = entrypoint
        self.run_config = run_config
        self.config_url = config_url
        self.output_url = output_url
        self.run_key = run_key
        self.args = args
        self.num_workers = num_workers
        self.summary_url = summary_url
        self.env = env
        self.grace_period_s = grace_period_s
        self.max_launch_attempts = max_launch_attempts
        self.preemption_reschedules = preemption_reschedules
        self.preemption_reschedule_delay_s = preemption_reschedule_delay_s
        self.manifest_sha256 = manifest_sha256
        self.group: RecordedLaunch | None = None  # must be set for on_kill
        self._killed = False
        self._live_metrics: LiveLineReader | None = None

    @cached_property
    def config(self) -> RunConfig:
        """The run's configuration, loaded once in this process and held to the access policy again, here where its
        environment is: a rewritten XCom launches nothing."""
        if not isinstance(self.run_config, Mapping):
            raise TypeError(f"run_config must be the prepared run's configuration (a mapping), got {self.run_config!r}")
        try:
            return RunConfig.from_saved(self.run_config, policy=AccessPolicy.from_env())
        except ConfigError as error:
            raise AirflowFailException(f"{self.task_id} launches no workers: its configuration is refused: "
                                       f"{error}") from error

    @cached_property
    def hook(self) -> StorageCredentialsHook:
        return StorageCredentialsHook(self.config.storage_conn_id)

    # -- Airflow entry points ---------------------------------------------------------------------------------

    def execute(self, context: Any) -> dict[str, Any]:
        self._refuse_a_run_that_is_over(context["ti"])
        self._check_run(context["ti"])
        spec = self._group_spec()
        run = StorageLayout(absolute_root(self.config.storage_root)).run(spec.run_key)
        try:
            backend = make_backend(self.config)
        except UnknownBackendError as error:
            raise LaunchError(str(error)) from None
        try:
            spec = self.plan_group(context, spec, backend)
        except BaseException:
            backend.close()
            raise
        self._live_metrics = LiveLineReader(run=spec.run_key, task=self.task_id)
        ti = context["ti"]
        idle = IdleSettings.of(self.config, ti.run_id, self.task_id)
        if self._live_metrics.enabled or idle.max_idle_held_s:  # per-step lines: Airflow's metrics, step progress
            spec = dataclasses.replace(spec, env={**spec.env, LIVE_INTERVAL_ENV: str(LIVE_INTERVAL_S)})
        try:
            self.group = RecordedLaunch(
                spec, backend, run, on_line=self._log_worker_line, storage=self.hook.applied, idle=idle,
                on_record=lambda record: ti.xcom_push(key=STATE_XCOM_KEY, value=record.to_json()))
            result = self.group.run_group(stopped=lambda: self._killed)
        finally:
            backend.close()
            if self._live_metrics.malformed:
                self.log.warning("%d malformed live metrics line(s) ignored (the ranks' log files keep them)",
                                 self._live_metrics.malformed)
        if self.group.reclaimed is not None and not self._killed:
            raise IdleReclaimedError(result, self.group.reclaimed.text)
        if self._killed or result.state is GroupState.STOPPED:
            raise WorkerGroupStoppedError(result)
        if not result.succeeded:
            raise self._failure(result, context)
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
            grace_s = min(self.grace_period_s, ON_KILL_GRACE_S)
            self.group.stop(f"task {self.task_id} was killed (SIGTERM, marked failed or execution_timeout)", grace_s)

    def _check_run(self, ti: Any) -> None:
        """The run key from the task's own (dag_id, run_id) unless one was given, the configuration loaded (and held
        to the access policy again, here where its environment is), and the storage URLs of the argv and the summary
        held to the run's layout: a rewritten one launches nothing."""
        if not self.run_key:
            self.run_key = layout_run_key(ti.dag_id, ti.run_id)
        cfg = self.config
        if isinstance(self.args, (list, tuple)) and isinstance(self.run_key, str) and self.run_key:
            argv = self.worker_args(self.config_url)
            try:
                check_launch_urls(argv, cfg.storage_root, self.run_key)
            except ConfigError as error:
                raise AirflowFailException(f"{self.task_id} launches no workers: {error}") from error
            self._check_manifest_pin(argv)
        expected = TrainOutput(str(self.output_url)).summary
        if self.summary_url is not None and (self.output_url is None or self.summary_url != expected):
            raise AirflowFailException(
                f"{self.task_id} launches no workers: its summary_url {self.summary_url!r} is not the summary.json of "
                f"its --output (it must be {expected!r}). The prepared run's XCom was changed, or the DAG passes "
                "another path: pass the prepared run's summary of that output.")

    def config_sha256(self) -> str | None:
        """The sha256 the workers pin for their `--config` file: of the bytes of the configuration this operator
        checked, as prepare wrote them (the run's, or its baseline's for baseline_config.json); None without one."""
        argv = self.worker_args(self.config_url)
        if "--config" not in argv[:-1]:
            return None
        config_url = argv[argv.index("--config") + 1]
        cfg = self.config
        run = StorageLayout(absolute_root(cfg.storage_root)).run(str(self.run_key))
        configs = {run.config: cfg, run.baseline_config: cfg.baseline_config()}
        if config_url not in configs:
            raise AirflowFailException(
                f"{self.task_id} launches no workers: its --config {config_url!r} is neither {run.config!r} nor "
                f"{run.baseline_config!r}, the files of the configuration it checked.")
        return hashlib.sha256(config_bytes(configs[config_url])).hexdigest()

    def _check_manifest_pin(self, argv: Sequence[str]) -> None:
        if "--manifest" in argv and not (isinstance(self.manifest_sha256, str) and self.manifest_sha256):
            raise AirflowFailException(
                f"{self.task_id} launches no workers: its --manifest has no pinned digest (manifest_sha256 is "
                f"{self.manifest_sha256!r}): pass the prepared run's XCom 'manifest_sha256', so that the workers "
                "train and evaluate only on the dataset the Airflow side read.")

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

    def _failure(self, result: RunResult, context: Any) -> BaseException:
        """What a failed group raises: see the module doc."""
        codes = {failure.exit_code for failure in result.failures.values()}
        if EXIT_PERMANENT in codes:
            return NotRetryableError(result)
        error = error_for(result)
        if codes != {EXIT_PREEMPTED}:
            return error
        done = int(context.get("task_reschedule_count") or 0)
        if done >= self.preemption_reschedules:
            self.log.warning("%s was preempted again after %d free reschedule(s) (preemption_reschedules=%d): this "
                             "failure uses the task's retries", self.task_id, done, self.preemption_reschedules)
            return error
        self.log.warning("%s was preempted (every rank saved a checkpoint on SIGTERM and exited %d): rescheduled in "
                         "%g s without spending a retry (%d of %d), resuming from that checkpoint", self.task_id,
                         EXIT_PREEMPTED, self.preemption_reschedule_delay_s, done + 1, self.preemption_reschedules)
        return AirflowRescheduleException(datetime.now(UTC) + timedelta(seconds=self.preemption_reschedule_delay_s))

    def plan_group(self, context: Any, spec: GroupSpec, backend: Any) -> GroupSpec:
        """The group to launch now; subclasses may shrink it to what the backend can place
        (`tf_multiworker.elastic.ElasticTrainOperator`). Runs after the backend exists, before anything starts."""
        return spec

    # -- helpers ----------------------------------------------------------------------------------------------

    def _group_spec(self) -> GroupSpec:
        """The rendered arguments and the run's configuration as launch settings: fail before anything starts."""
        if isinstance(self.args, (str, bytes)) or not isinstance(self.args, (list, tuple)):
            raise TypeError(f"args must be a list, got {self.args!r}")
        if any(isinstance(arg, bool) or not isinstance(arg, (str, int, float)) for arg in self.args):
            raise TypeError(f"args must be strings or numbers, got {list(self.args)!r}")
        if self.env is not None and not isinstance(self.env, dict):
            raise TypeError(f"env must be a mapping of variable names to values, got {self.env!r}")
        if not isinstance(self.run_key, str) or not self.run_key:
            raise TypeError(f"run_key must be the prepared run's key, got {self.run_key!r}")
        for name in ("config_url", "output_url", "summary_url"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), str):
                raise TypeError(f"{name} must be a URL, got {getattr(self, name)!r}")
        env = {name: str(value) for name, value in (self.env or {}).items()}
        pinned = self.config_sha256()
        if pinned:  # after `env`: the pinned digest is of what this operator checked, never a caller's
            env[CONFIG_SHA256_ENV] = pinned
        if self.manifest_sha256:  # the prepared run's, never a caller's
            env[MANIFEST_SHA256_ENV] = self.manifest_sha256
        cfg = self.config
        return GroupSpec(
            name=self.task_id,
            entrypoint=self.entrypoint,
            args=self.worker_args(self.config_url),
            num_workers=self.num_workers or cfg.num_workers,
            use_gpu=cfg.use_gpu,
            env=env,
            # The run key marks every worker of the run, so release finds even those no record names.
            run_key=self.run_key,
            secret_env=self.hook.env,
            startup_timeout_s=cfg.launch.startup_timeout_s,
            hang_timeout_s=cfg.launch.hang_timeout_s,
            grace_period_s=max(self.grace_period_s, cfg.preemption_checkpoint_s + PREEMPTION_MARGIN_S),
            max_launch_attempts=self.max_launch_attempts,
        )

    def worker_args(self, config_url: str | None) -> tuple[str, ...]:
        """The entry point's argv: `--config <config_url>` and `--output <output_url>` when set, then `args`."""
        files = (("--config", config_url), ("--output", self.output_url))
        return (*(part for flag, url in files if url for part in (flag, str(url))), *(str(arg) for arg in self.args))

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
            # Seconds from the group's exit to the backend's proof that its slots (GPUs; on CPU host and rank) are
            # free, checked right then (tasks/launch.py); None when not proven there (release checks them again).
            "release_after_train_s": (self.group.after_exit.release_after_train_s
                                      if self.group and self.group.after_exit else None),
        }
