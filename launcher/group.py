"""Run one worker group to the end: launch, stream logs, watch, and stop every rank as one.

The supervising loop runs in the caller's thread; one reader thread per rank copies output to the rank's log
file and hands lines back to the loop (launcher/worker_output.py), which passes them to `on_line` in the caller's
thread (Airflow's task logger is used from there only). `stop()` may be called from another thread or a signal handler.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from core.clock import utc_now
from core.protocol import ABORT_SIGNAL, EXIT_PREEMPTED, GROUP_ENV, RUN_KEY_ENV
from launcher.backend import Backend
from launcher.errors import LaunchError
from launcher.failures import exit_failure, hang_failure, startup_failure
from launcher.idle import IdleWatch
from launcher.log_policy import verbose_environment
from launcher.process import ORPHAN_GRACE_S, stop_ladder
from launcher.spec import (
    FailureKind,
    GroupSpec,
    GroupState,
    RunResult,
    WorkerFailure,
    WorkerOutcome,
    WorkerSpec,
    WorkerState,
)
from launcher.tf_env import tensorflow_env
from launcher.worker_output import LineSink, OutputRelay, RunningWorker

log = logging.getLogger(__name__)

POLL_INTERVAL_S = 0.05
STARTUP_PROGRESS_EVERY_S = 30.0
READER_JOIN_S = 2.0
StartedSink = Callable[[Sequence[WorkerOutcome], int], None]


def end_earlier_attempts(spec: GroupSpec, backend: Backend) -> None:
    """An earlier attempt of this task whose launcher was killed outright may have left workers that still train,
    hold GPUs and write checkpoints: they are ended before this attempt starts beside them, and before anything
    counts the GPUs they hold (an elastic launch's `capacity`)."""
    hosts = backend.end_earlier_attempts(spec)
    for host in hosts:
        if host.error:
            log.warning("could not check host %s for workers an earlier attempt of %s left: %s", host.host,
                        spec.name, host.error)
        elif host.found:
            log.warning("ended what an earlier attempt of %s left alive on %s: %s (SIGTERM: %s, SIGKILL: %s)",
                        spec.name, host.host, "; ".join(f"pid {p.get('pid')} {str(p.get('cmdline'))[:120]}"
                                                        if isinstance(p, dict) else str(p) for p in host.found),
                        list(host.terminated), list(host.killed))
    survivors = [f"{survivor} on {host.host}" for host in hosts for survivor in host.survivors]
    if survivors:
        raise LaunchError(
            f"group {spec.name}: an earlier attempt's workers are still alive after SIGKILL: "
            f"{', '.join(map(str, survivors))}. Not launching beside them: end them on their hosts "
            "(kill -9 <pid>, or delete the pods) and clear the task.")


class WorkerGroup:
    """Launches `spec` on `backend`, streams every rank's output, and ends the group as one (see module doc).

    `supervisor_pid`: the process that supervises this one (an Airflow task's supervisor). When it dies, killed
    without a word to us (SIGKILL, the OOM killer), nobody will ever read this task's result: the group is
    stopped at once instead of training on unseen beside the retry that follows.

    `idle`: the idle-held watch (launcher/idle.py) fed with every rank's lines and polled by the watch loop; it only
    reports, through its own callback.
    """

    def __init__(self, spec: GroupSpec, backend: Backend, workdir: str | Path, *,
                 on_line: LineSink | None = None, on_started: StartedSink | None = None,
                 supervisor_pid: int | None = None, idle: IdleWatch | None = None) -> None:
        self.spec = spec
        self.backend = backend
        self.supervisor_pid = supervisor_pid
        self.workdir = Path(workdir)
        self.log_dir = self.workdir / "logs"
        self.on_started = on_started
        self.idle = idle
        self.output = OutputRelay(on_line or (lambda rank, line: log.info("[rank %d] %s", rank, line)),
                                  spec.secret_env, use_gpu=spec.use_gpu, idle=idle)
        self._workers: list[RunningWorker] = []
        self._stop_requested = threading.Event()

    # -- public -----------------------------------------------------------------------------------------------

    def run(self) -> RunResult:
        started = time.monotonic()
        self.log_dir.mkdir(parents=True, exist_ok=True)
        for line in self.spec.describe():
            log.info("%s", line)
        if self.spec.run_key:
            end_earlier_attempts(self.spec, self.backend)
        attempt = 0
        state, failures = GroupState.STOPPED, {}
        while attempt < self.spec.max_launch_attempts and not self._stop_requested.is_set():
            attempt += 1
            state, failures = self._run_attempt(attempt)
            bind_only = failures and all(f.kind is FailureKind.PORT_BIND for f in failures.values())
            if not bind_only or attempt == self.spec.max_launch_attempts:
                break
            log.warning("attempt %d: rank(s) %s could not bind their port; relaunching the group on new ports "
                        "(attempt %d of %d)", attempt, sorted(failures), attempt + 1, self.spec.max_launch_attempts)
        return RunResult(
            name=self.spec.name,
            state=state,
            workers=tuple(w.outcome() for w in self._workers),
            failures=dict(failures),
            attempts=attempt,
            wall_time_s=time.monotonic() - started,
            log_files={w.spec.rank: w.spec.log_file for w in self._workers},
        )

    def stop(self, reason: str, grace_s: float | None = None) -> None:
        """Stop every worker (SIGTERM, `grace_s` or the spec's grace period, SIGKILL); `run` returns STOPPED."""
        log.warning("stopping worker group %s: %s", self.spec.name, reason)
        self._stop_requested.set()
        self._stop_workers(list(self._workers), grace_s)

    # -- one attempt ------------------------------------------------------------------------------------------

    def _run_attempt(self, attempt: int) -> tuple[GroupState, dict[int, WorkerFailure]]:
        workers: list[RunningWorker] = []
        self._workers = workers
        outcome = None
        try:
            self._launch(attempt, workers)
            if self.on_started and not self._stop_requested.is_set():
                self.on_started([w.outcome() for w in workers], attempt)
            if self.idle:
                outcomes = [w.outcome() for w in workers]
                self.idle.start(self.spec.name, attempt, [w.spec.rank for w in workers],
                                lambda: self.backend.utilization(self.spec, outcomes) or {})
            outcome = self._watch(workers)
            return outcome
        finally:
            if self.idle:
                self.idle.stop()
            self._stop_workers(workers, failed=self._failed_ranks(outcome))
            for worker in workers:
                if worker.reader:
                    worker.reader.join(READER_JOIN_S)
            self.backend.end_group(self.spec)
            self.output.drain()
            for worker in workers:
                worker.log_file.close()
                if worker.exit_code is None:
                    worker.exit_code = worker.handle.poll()
                if worker.state in (WorkerState.STARTING, WorkerState.READY):
                    worker.state = WorkerState.SUCCEEDED if worker.exit_code == 0 else WorkerState.STOPPED

    def _launch(self, attempt: int, workers: list[RunningWorker]) -> None:
        placements = self.backend.place(self.spec)
        command = self.backend.command(self.spec)
        log.info("attempt %d of %d on backend %s: %s", attempt, self.spec.max_launch_attempts, self.backend.name,
                 " ".join(command))
        marker = {RUN_KEY_ENV: self.spec.run_key, GROUP_ENV: self.spec.name} if self.spec.run_key else {}
        for rank, placement in enumerate(placements):
            rank_dir = self.workdir / f"rank-{rank}"
            rank_dir.mkdir(parents=True, exist_ok=True)
            spec = WorkerSpec(rank=rank, num_workers=len(placements), placement=placement,
                              log_file=str(self.log_dir / f"rank-{rank}.log"), workdir=str(rank_dir))
            env = {**self.spec.env, **marker, **verbose_environment(), **tensorflow_env(placements, rank)}
            where = "".join(f" {k}={v}" for k, v in placement.where.items())
            log.info("  rank %d: %s devices=%s%s TF_CONFIG=%s", rank, spec.address,
                     "cpu" if spec.devices == () else list(spec.devices or []) or "backend", where,
                     env.get("TF_CONFIG"))
            if self._stop_requested.is_set():
                return
            # Closed in _run_attempt's finally: the reader thread writes to it until the worker's output ends.
            log_file = open(spec.log_file, "a", encoding="utf-8")  # noqa: SIM115
            stamp = utc_now()
            log_file.write(f"===== {self.spec.name} attempt {attempt}, rank {rank}, {spec.address}, {stamp} =====\n")
            try:
                handle = self.backend.start(self.spec, spec, command, env)
            except BaseException:
                log_file.close()
                raise
            worker = RunningWorker(spec, handle, log_file)
            workers.append(worker)
            worker.reader = threading.Thread(target=self.output.pump, args=(worker,), daemon=True,
                                             name=f"{self.spec.name}-rank-{rank}-output")
            worker.reader.start()

    def _watch(self, workers: list[RunningWorker]) -> tuple[GroupState, dict[int, WorkerFailure]]:
        started = self.output.last_output = time.monotonic()
        self._next_progress = started + STARTUP_PROGRESS_EVERY_S
        self._joined_at: float | None = None
        while True:
            self.output.drain_poll()
            self._stop_if_orphaned()
            if self.idle:
                self.idle.poll()  # may stop the group (a reclaim of idle slots)
            if self._stop_requested.is_set():
                return GroupState.STOPPED, {}
            outcome = self._outcome(workers, time.monotonic(), started)
            if outcome is not None:
                return outcome
            time.sleep(POLL_INTERVAL_S)

    def _stop_if_orphaned(self) -> None:
        if self.supervisor_pid is not None and os.getppid() != self.supervisor_pid:
            # Reparented: the supervisor is gone. Its task is failed already and a retry may be on its way.
            self.stop(f"this task's supervisor (pid {self.supervisor_pid}) is gone, killed without warning "
                      "(SIGKILL, the OOM killer): nobody will read this attempt's result", ORPHAN_GRACE_S)

    def _outcome(self, workers: list[RunningWorker], now: float,
                 started: float) -> tuple[GroupState, dict[int, WorkerFailure]] | None:
        """How the group ended, when this poll sees it end; None while it runs."""
        elapsed = now - started
        for worker in workers:
            if worker.exit_code is None:
                worker.exit_code = worker.handle.poll()
            if worker.state is WorkerState.STARTING and worker.ready_seen:
                worker.state = WorkerState.READY
        failed = [w for w in workers if w.exit_code not in (None, 0)]
        if failed:
            return GroupState.FAILED, {w.spec.rank: self._exit_failure(w, elapsed) for w in failed}
        if all(w.exit_code == 0 for w in workers):
            return GroupState.SUCCEEDED, {}
        starting = [w for w in workers if w.state is WorkerState.STARTING and w.exit_code is None]
        if starting:
            return self._startup_outcome(starting, workers, now, elapsed)
        # The watchdog starts once every rank has joined; before that the start-up timeout applies.
        self._joined_at = self._joined_at or now
        silent_s = now - max(self.output.last_output, self._joined_at)
        if silent_s > self.spec.hang_timeout_s:
            alive = [w for w in workers if w.exit_code is None]
            return GroupState.FAILED, {w.spec.rank: self._hang_failure(w, elapsed, silent_s) for w in alive}
        return None

    def _startup_outcome(self, starting: list[RunningWorker], workers: list[RunningWorker], now: float,
                         elapsed: float) -> tuple[GroupState, dict[int, WorkerFailure]] | None:
        if elapsed > self.spec.startup_timeout_s:
            return GroupState.FAILED, {w.spec.rank: self._startup_failure(w, elapsed, workers) for w in starting}
        if now >= self._next_progress:
            log.info("waiting for rank(s) %s to join the group: %.0f s of startup_timeout_s=%g",
                     [w.spec.rank for w in starting], elapsed, self.spec.startup_timeout_s)
            self._next_progress = now + STARTUP_PROGRESS_EVERY_S
        return None

    # -- failures ---------------------------------------------------------------------------------------------

    def _exit_failure(self, worker: RunningWorker, elapsed: float) -> WorkerFailure:
        if worker.reader:
            worker.reader.join(READER_JOIN_S)  # the last lines are the ones that explain the exit
        joined = worker.state is WorkerState.READY
        worker.state = WorkerState.FAILED
        return exit_failure(worker.spec, worker.handle.pid, worker.exit_code, elapsed, tuple(worker.tail),
                            joined=joined)

    def _startup_failure(self, worker: RunningWorker, elapsed: float, workers: list[RunningWorker]) -> WorkerFailure:
        worker.state = WorkerState.FAILED
        return startup_failure(worker.spec, worker.handle.pid, elapsed, tuple(worker.tail),
                               timeout_s=self.spec.startup_timeout_s, waiting=worker.handle.waiting_reason(),
                               joined=[w.spec.rank for w in workers if w.state is WorkerState.READY])

    def _hang_failure(self, worker: RunningWorker, elapsed: float, silent_s: float) -> WorkerFailure:
        worker.state = WorkerState.FAILED
        return hang_failure(worker.spec, worker.handle.pid, elapsed, tuple(worker.tail),
                            timeout_s=self.spec.hang_timeout_s, silent_s=silent_s)

    # -- plumbing ---------------------------------------------------------------------------------------------

    def _failed_ranks(self, outcome: tuple[GroupState, dict[int, WorkerFailure]] | None) -> list[int]:
        """The ranks whose failure ended this attempt, when the others are to be aborted rather than asked to stop:
        none when the group was stopped from outside (its ladder runs already), when the attempt raised, or when every
        failed rank exited EXIT_PREEMPTED (the others are saving the checkpoint they agreed on)."""
        if outcome is None or self._stop_requested.is_set():
            return []
        state, failures = outcome
        if state is not GroupState.FAILED or all(f.exit_code == EXIT_PREEMPTED for f in failures.values()):
            return []
        return sorted(failures)

    def _stop_workers(self, workers: list[RunningWorker], grace_s: float | None = None,
                      failed: Sequence[int] = ()) -> None:
        """The stop ladder for every worker still running: SIGTERM (a preemption notice: a rank saves a checkpoint
        at the step all agree on), or ABORT_SIGNAL when rank(s) `failed` failed: no checkpoint can be agreed without
        them, so the others end at once (one writing a checkpoint finishes it first); SIGKILL after the grace."""
        grace_s = self.spec.grace_period_s if grace_s is None else grace_s
        first = ABORT_SIGNAL.name if failed else "SIGTERM"
        alive = [w.spec.rank for w in workers if not w.handle.gone()]
        if failed and alive:
            log.warning("rank(s) %s failed: stopping what is left of rank(s) %s with %s, at once (a checkpoint "
                        "cannot be agreed without the failed rank(s); the retry resumes from the last one saved)",
                        list(failed), alive, first)

        def warn(worker: RunningWorker) -> None:
            log.warning("rank %d (host %s, pid %s) still running %g s after %s: sending SIGKILL",
                        worker.spec.rank, worker.spec.host, worker.handle.pid, grace_s, first)

        stop_ladder(workers, terminate=(lambda w: w.handle.abort()) if failed else (lambda w: w.handle.terminate()),
                    kill=lambda w: w.handle.kill(), gone=lambda w: w.handle.gone(), grace_s=grace_s, on_kill=warn)
