"""One launch path for every task that runs workers (train, preflight and baseline through the operator, each model
evaluation of the evaluate task): a launcher work directory on this host, the run-state record in storage from
the moment the ranks start to the end (release finds the group by it), the ranks' log files uploaded at the end
(also when the group failed), and the work directory removed.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from pathlib import Path

from core.clock import utc_now, utc_timestamp
from core.config import RunConfig
from core.layout import RunLayout
from core.protocol import LAUNCHER_WORKDIR_PREFIX, is_ready_marker
from core.storage import exists, join, read_json, upload_tree, write_json_atomic
from launcher import GroupSpec, GroupState, RunResult, WorkerGroup, WorkerOutcome
from launcher.backend import Backend
from launcher.host_identity import describe, host_identity, same_host
from launcher.idle import IdleEpisode, IdleRules, IdleWatch
from launcher.state_record import RecordedWorker, SlotsCheck, StateRecord
from tasks import telemetry
from tasks.ledger.usage import AttemptEvents, IdleWarning, RankEvents, slots_of
from trainer.metrics import LIVE_PREFIX

log = logging.getLogger("gpt_finetune.launch")


def task_supervisor_pid() -> int | None:
    """The process that supervises this Airflow task: the task runner's parent (a LocalExecutor worker, a Celery
    pool child). When it is killed outright (SIGKILL, the OOM killer) the scheduler fails the task at once, but the
    task runner is only re-parented and runs on, so the group stops when it is gone. None when the task runs
    in-process (`airflow dags test`) or outside Airflow."""
    from airflow.sdk.execution_time import task_runner
    from airflow.sdk.execution_time.supervisor import InProcessSupervisorComms

    comms = getattr(task_runner, "SUPERVISOR_COMMS", None)
    if comms is None or isinstance(comms, InProcessSupervisorComms):
        return None
    return os.getppid()


def release_after_exit(run: RunLayout, group: str) -> float | None:
    """`release_after_train_s` of group `group`'s state record: seconds from its exit to the proof that its slots
    were free; None without a record or a proof, or from a record that is not one (logged, naming it)."""
    url = run.state_file(group)
    try:
        after = StateRecord.from_json(read_json(url), url).after_exit if exists(url) else None
        return after.release_after_train_s if after else None
    except Exception as error:  # noqa: BLE001 - a figure of the report, never a failure
        log.info("could not read the state record %s (%s)", url, error)
        return None


def live_step(line: str) -> int | None:
    """The step a worker's live metrics line reports (trainer/metrics.py); None for any other line."""
    if not line.startswith(LIVE_PREFIX):
        return None
    try:
        scope, values = telemetry.parse_live_line(line[len(LIVE_PREFIX):])
    except telemetry.MalformedLiveLine:
        return None
    step = values.get("step") if scope == "worker" else None
    return int(step) if step is not None and math.isfinite(step) else None


@dataclass(frozen=True)
class IdleSettings:
    """The idle-held warning of a launch (launcher/idle.py): `max_idle_held_s` (0 = off), `idle_gpu_util_pct` (GPU
    runs), `reclaim_idle_after_s` (stop the group idle that long; 0 = off), and `mail(text, reclaimed)`, which sends a
    warning or a reclaim without waiting (tasks.alerts.alert_in_background), or None."""

    max_idle_held_s: float = 0.0
    idle_gpu_util_pct: float = 5.0
    mail: Callable[[str, bool], object] | None = None
    reclaim_idle_after_s: float = 0.0

    @classmethod
    def of(cls, cfg: RunConfig, run_id: str | None, task: str) -> IdleSettings:
        """From the run's config (`monitoring`); mailed when it names an alert connection (and the run is known)."""
        from tasks.alerts import alert_in_background

        def mail(text: str, reclaimed: bool) -> object:
            what = f"GPUs held idle reclaimed from {task}" if reclaimed else f"GPUs held idle in {task}"
            return alert_in_background(cfg, str(run_id), what, text, task=task, fails=reclaimed)

        watch = cfg.monitoring
        return cls(float(watch.max_idle_held_s), float(watch.idle_gpu_util_pct),
                   mail if watch.alert_conn_id and run_id else None, float(watch.reclaim_idle_after_s))


@dataclass
class _RunningAttempt:
    """The running attempt's GPU-time events as they come (READY markers, idle-held warnings); `events()` is what
    its file keeps once it ended."""

    attempt: int
    try_number: str | None  # Airflow's try of the task; None outside Airflow
    launched: float
    workers: dict[int, WorkerOutcome]  # by rank
    ready: dict[int, float] = field(default_factory=dict)
    idle_warnings: list[IdleWarning] = field(default_factory=list)
    reclaimed: IdleWarning | None = None

    def slots(self, rank: int) -> list[str]:
        worker = self.workers.get(rank)
        return slots_of(worker.host, rank, worker.devices or ()) if worker else slots_of(None, rank, ())

    def events(self, group: str, backend: str, state: str, exit_codes: Mapping[int, int | None],
               ended: float) -> AttemptEvents:
        ranks = tuple(RankEvents(rank=w.rank, host=w.host, gpus=tuple(w.devices or ()), launch=self.launched,
                                 exit=ended, exit_code=exit_codes.get(w.rank), ready=self.ready.get(w.rank))
                      for w in self.workers.values())
        return AttemptEvents(group, backend, self.attempt, self.try_number, state, ranks, tuple(self.idle_warnings),
                             self.reclaimed)


class RecordedLaunch:
    """Runs `spec` on `backend` as a task's group `spec.name` of the run laid out by `run`.

    `on_line(rank, line)` gets every worker line (`label(rank)` names the rank the backend's way); `storage()`
    is the context in which storage is written (the operator's connection credentials); `on_record(record)` sees
    each state record written (the operator pushes it to XCom). `stop()` may be called from a signal handler.
    `idle`: the live idle-held warning; each one is logged, counted, recorded with the attempt's GPU-time events
    (`idle_warnings`, read by the report) and mailed off the watch loop.
    """

    def __init__(self, spec: GroupSpec, backend: Backend, run: RunLayout, *, on_line: Callable[[int, str], None],
                 storage: Callable[[], AbstractContextManager] = contextlib.nullcontext,
                 on_record: Callable[[StateRecord], None] | None = None,
                 idle: IdleSettings | None = None) -> None:
        self.spec, self.backend, self.run = spec, backend, run
        self.storage, self.on_record = storage, on_record
        self.workdir = Path(tempfile.mkdtemp(prefix=f"{LAUNCHER_WORKDIR_PREFIX}{spec.name}-"))
        self._labels: dict[int, str] = {}
        self.after_exit: SlotsCheck | None = None  # _check_slots_free's result, once the group exited
        self._recorded = False  # this launch wrote its first state record
        self._attempt: _RunningAttempt | None = None  # the running attempt's GPU-time events (tasks/ledger/usage.py)
        self._on_line = on_line
        self.idle = idle or IdleSettings()
        self.reclaimed: IdleWarning | None = None  # set when the group was stopped as idle (`_reclaim`)
        watch = None  # max_idle_held_s = 0: no warning, no watch
        if self.idle.max_idle_held_s > 0:
            reclaim_s = self.idle.reclaim_idle_after_s
            rules = IdleRules(self.idle.max_idle_held_s, reclaim_after_s=reclaim_s,
                              util_below_pct=self.idle.idle_gpu_util_pct if spec.use_gpu else None)
            watch = IdleWatch(rules, live_step, self._idle_held, on_reclaim=self._reclaim if reclaim_s else None)
        self.group = WorkerGroup(spec, backend, self.workdir, on_line=self._line, on_started=self._started,
                                 supervisor_pid=task_supervisor_pid(), idle=watch)

    @property
    def state_url(self) -> str:
        return self.run.state_file(self.spec.name)

    @property
    def logs_url(self) -> str:
        return self.run.logs(self.spec.name)

    def label(self, rank: int) -> str:
        """The rank as its backend names it: "rank 2", "rank 2 host h", "rank 2 pod p"."""
        return self._labels.get(rank) or f"rank {rank}"

    def run_group(self, stopped: Callable[[], bool] = lambda: False) -> RunResult:
        """The group's result; the final state record and the logs are written whatever happened. `stopped()`
        says whether the task was killed meanwhile (its group is then recorded as stopped)."""
        result: RunResult | None = None
        try:
            result = self.group.run()
            if not stopped():  # a killed task has seconds left: release proves its slots free
                self.after_exit = self._check_slots_free(result)
        except BaseException:  # the task is being ended (SystemExit, KeyboardInterrupt): no worker may outlive it
            self.group.stop(f"the task running {self.spec.name} is ending")
            raise
        finally:
            final = GroupState.STOPPED if stopped() else (result.state if result else GroupState.FAILED)
            self._finish(final, result, failing=stopped() or result is None or not result.succeeded)
        return result

    def stop(self, reason: str, grace_s: float | None = None) -> None:
        self.group.stop(reason, grace_s)

    def _check_slots_free(self, result: RunResult) -> SlotsCheck:
        """Right after the group exited: the backend's proof that the slots it held are free (launcher/gpus.py for the
        local backend), so a run's GPUs are known released as soon as training ends, not only at release.
        `release_after_train_s`: seconds from the group's exit to that proof; None when not proven here. Evidence
        only: an error is logged, and release checks the slots again."""
        exited = time.monotonic()
        try:
            check = SlotsCheck.from_json(self.backend.check_slots_free(self.spec, result.workers),
                                         f"the {self.backend.name} backend's check of the slots of {self.spec.name}")
        except Exception as error:  # noqa: BLE001 - evidence must not fail the task
            log.warning("could not check that the slots of %s are free after it exited: %s", self.spec.name, error)
            check = SlotsCheck.failed(f"the check failed: {error}")
        if check.proven:
            check = replace(check, release_after_train_s=round(time.monotonic() - exited, 3))
            log.info("the %s slots of %s are free %.3f s after its workers exited", check.evidence.get("slots", ""),
                     self.spec.name, check.release_after_train_s)
        elif check.checked:
            log.warning("the slots of %s are not proven free after its workers exited (%s): release checks them again",
                        self.spec.name, {"free": check.free, **check.evidence})
        return check

    def _warn_of_an_earlier_attempt_elsewhere(self) -> None:
        """The backend's sweep of earlier attempts (`end_earlier_attempts`) sees only this host: say so when the
        group's last record is a local attempt that never finished, launched from another host. Called in the
        storage context, before this launch's first record replaces it."""
        url = self.state_url
        try:
            earlier = StateRecord.from_json(read_json(url), url) if exists(url) else None
        except Exception as error:  # noqa: BLE001 - a warning's evidence must not stop the launch
            log.info("could not read the earlier state record %s (%s): not compared", url, error)
            return
        if earlier is None or earlier.backend != "local" or earlier.state != "running":
            return
        here = host_identity()
        if same_host(earlier.launcher, here):
            return
        log.warning(
            "An earlier attempt of %s (state record %s, never finished) was launched on %s; this attempt runs on %s, "
            "whose sweep of earlier attempts cannot see that host: its workers may still run there, holding GPUs and "
            "writing the same checkpoints. Route every attempt to one host (set gpu_queue to a queue that only that "
            "host's Celery worker serves), and check that host (its workers carry TFMW_RUN_KEY=%s).",
            self.spec.name, self.state_url, describe(earlier.launcher), describe(here), self.spec.run_key)

    def _line(self, rank: int, line: str) -> None:
        if self._attempt is not None and rank in self._attempt.workers and is_ready_marker(line):
            self._attempt.ready.setdefault(rank, time.time())
        self._on_line(rank, line)

    def _idle_held(self, episode: IdleEpisode) -> None:
        """One idle-held episode (the group's watch loop calls this): logged, counted, recorded, mailed off-loop."""
        warning = self._idle_record(episode, f"max_idle_held_s = {self.idle.max_idle_held_s:g}", "The run goes on.")
        log.warning("%s", warning.text)
        telemetry.count("cost_warning", {"run": self.spec.run_key, "task": self.spec.name})
        if self._attempt is not None:
            self._attempt.idle_warnings.append(warning)
        if self.idle.mail is not None:
            self.idle.mail(warning.text, False)

    def _reclaim(self, episode: IdleEpisode) -> None:
        """Every rank idle for `reclaim_idle_after_s` (the watch loop calls this once per attempt): logged, counted,
        recorded and mailed as the warning is; then the group is stopped with SIGTERM, a preemption notice, so that
        ranks that can still step save a checkpoint at the step they agree on. The task then fails without a retry
        (`reclaimed`, read by the operator)."""
        reclaim = self._idle_record(
            episode, f"reclaim_idle_after_s = {self.idle.reclaim_idle_after_s:g}",
            "Stopping the group: its ranks save a checkpoint if they still can, and the task fails without a retry.",
            prefix=f"reclaimed after {episode.idle_s:.0f} s idle: ")
        self.reclaimed = reclaim
        try:
            log.warning("%s", reclaim.text)
            telemetry.count("cost_warning", {"run": self.spec.run_key, "task": self.spec.name})
            if self._attempt is not None:
                self._attempt.reclaimed = reclaim
            if self.idle.mail is not None:
                self.idle.mail(reclaim.text, True)
        finally:  # the slots are reclaimed whatever became of the record and the mail
            self.group.stop(reclaim.text)

    def _idle_record(self, episode: IdleEpisode, limit: str, then: str, prefix: str = "") -> IdleWarning:
        """An idle-held warning or a reclaim as the attempt's events keep it, its text naming the limit crossed."""
        running = self._attempt
        slots = [s for rank in episode.ranks for s in (running.slots(rank) if running else slots_of(None, rank, ()))]
        where = "; ".join(f"{self.label(rank)} {episode.phase[rank]}" + (
            f", GPU utilization at most {episode.peak_util_pct[rank]:.0f}%" if episode.peak_util_pct else "")
            for rank in episode.ranks)
        text = (f"{prefix}GPU time: {self.spec.name} (attempt {episode.attempt}) held {len(slots)} slot(s) {slots} "
                f"with no step progress for {episode.idle_s:.0f} s ({limit}"
                + (f", below idle_gpu_util_pct = {self.idle.idle_gpu_util_pct:g}%" if episode.peak_util_pct else "")
                + f"): {where}. {then}")
        return IdleWarning(
            at=utc_timestamp(episode.at), ranks=tuple(episode.ranks), slots=tuple(slots), idle_s=episode.idle_s,
            phase={str(r): p for r, p in episode.phase.items()},
            peak_util_pct={str(r): u for r, u in episode.peak_util_pct.items()} if episode.peak_util_pct else None,
            text=text)

    def _started(self, workers: Sequence[WorkerOutcome], attempt: int) -> None:
        self._write_usage(())  # a relaunch on new ports: the earlier attempt has ended
        self._attempt = _RunningAttempt(attempt, os.environ.get("AIRFLOW_CTX_TRY_NUMBER"), time.time(),
                                        {w.rank: w for w in workers})
        self._labels = {w.rank: w.label for w in workers}
        self._gpus_held(sum(len(self._attempt.slots(w.rank)) for w in workers))
        self._write_state(GroupState.RUNNING, workers)

    def _gpus_held(self, slots: int) -> None:
        """The live gauge of the slots this group holds (0 when it ended)."""
        telemetry.emit_gauges({telemetry.task_metric("usage", "gpus_held"): slots},
                              {"run": self.spec.run_key, "task": self.spec.name})

    def _write_usage(self, workers: Sequence[WorkerOutcome], state: GroupState | None = None) -> None:
        """The ended attempt's events, one file per group attempt under `runs/<key>/usage/` (append-only: a file is
        written once, never read back and rewritten). A storage error is logged: the ledger must not fail a run."""
        running, self._attempt = self._attempt, None
        if running is None:
            return
        ended = time.time()
        self._gpus_held(0)
        events = running.events(self.spec.name, self.backend.name, state.value if state else "relaunched",
                                {w.rank: w.exit_code for w in workers}, ended)
        stamp = datetime.fromtimestamp(running.launched if events.ranks else ended, UTC)
        name = f"{self.spec.name}-{stamp.strftime('%Y%m%dT%H%M%S.%f')}-a{events.attempt}.json"
        try:
            with self.storage():
                write_json_atomic(join(self.run.url, "usage", name), events.to_xcom())
        except Exception:  # a missing ledger entry is reported by the ledger, not by the task
            log.exception("could not record the GPU-time events of %s", self.spec.name)

    def _write_state(self, state: GroupState, workers: Sequence[WorkerOutcome]) -> None:
        record = StateRecord(
            task_id=self.spec.name, backend=self.backend.name, state=state.value, updated_at=utc_now(),
            workdir=str(self.workdir),  # removed at the end; release removes it when the task died first
            launcher=host_identity(),  # release checks a local group only from this same host and container
            workers=tuple(RecordedWorker(w.rank, w.host, w.port, tuple(w.devices or ()), dict(w.gpu_idle_mb),
                                         extra=dict(w.record)) for w in workers),
            after_exit=self.after_exit)  # _check_slots_free: the slots proven free right after the group exited
        with self.storage():
            if not self._recorded:
                self._warn_of_an_earlier_attempt_elsewhere()
                self._recorded = True
            write_json_atomic(self.state_url, record.to_json())
        if self.on_record:
            self.on_record(record)

    def _finish(self, state: GroupState, result: RunResult | None, *, failing: bool) -> None:
        """Final state record and log upload. When the group is already failing, a storage error here is logged so
        that it does not hide the workers' error; after a success it raises (artifacts complete or absent)."""
        self._write_usage(result.workers if result else (), state)
        try:
            self._write_state(state, result.workers if result else ())
            logs_dir = self.workdir / "logs"
            if logs_dir.is_dir():
                with self.storage():
                    uploaded = upload_tree(logs_dir, self.logs_url)
                log.info("uploaded %d worker log(s) to %s", len(uploaded), self.logs_url)
        except Exception:
            if not failing:
                raise
            log.exception("could not record the final state / upload worker logs of %s", self.spec.name)
        finally:
            shutil.rmtree(self.workdir, ignore_errors=True)
