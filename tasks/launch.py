"""One launch path for every task that runs workers (train, preflight and baseline through the operator, each model
evaluation of the evaluate task): a launcher work directory on this host, the run-state record in storage from
the moment the ranks start to the end (release finds the group by it), the ranks' log files uploaded at the end
(also when the group failed), and the work directory removed.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import tempfile
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from launcher import GroupSpec, GroupState, RunResult, WorkerGroup, WorkerOutcome
from launcher.backend import Backend
from launcher.protocol import LAUNCHER_WORKDIR_PREFIX
from trainer.layout import RunLayout
from trainer.storage import upload_tree, write_json_atomic

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


class RecordedLaunch:
    """Runs `spec` on `backend` as a task's group `spec.name` of the run laid out by `run`.

    `on_line(rank, line)` gets every worker line (`label(rank)` names the rank the backend's way); `storage()`
    is the context in which storage is written (the operator's connection credentials); `on_record(record)` sees
    each state record written (the operator pushes it to XCom). `stop()` may be called from a signal handler.
    """

    def __init__(self, spec: GroupSpec, backend: Backend, run: RunLayout, *, on_line: Callable[[int, str], None],
                 storage: Callable[[], AbstractContextManager] = contextlib.nullcontext,
                 on_record: Callable[[dict[str, Any]], None] | None = None) -> None:
        self.spec, self.backend, self.run = spec, backend, run
        self.storage, self.on_record = storage, on_record
        self.workdir = Path(tempfile.mkdtemp(prefix=f"{LAUNCHER_WORKDIR_PREFIX}{spec.name}-"))
        self._labels: dict[int, str] = {}
        self.group = WorkerGroup(spec, backend, self.workdir, on_line=on_line, on_started=self._started,
                                 supervisor_pid=task_supervisor_pid())

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
        except BaseException:  # the task is being ended (SystemExit, KeyboardInterrupt): no worker may outlive it
            self.group.stop(f"the task running {self.spec.name} is ending")
            raise
        finally:
            final = GroupState.STOPPED if stopped() else (result.state if result else GroupState.FAILED)
            self._finish(final, result, failing=stopped() or result is None or not result.succeeded)
        return result

    def stop(self, reason: str, grace_s: float | None = None) -> None:
        self.group.stop(reason, grace_s)

    def _started(self, workers: Sequence[WorkerOutcome], attempt: int) -> None:
        self._labels = {w.rank: w.label for w in workers}
        self._write_state(GroupState.RUNNING, workers)

    def _write_state(self, state: GroupState, workers: Sequence[WorkerOutcome]) -> None:
        record = {
            "task_id": self.spec.name,
            "backend": self.backend.name,
            "state": state.value,
            "updated_at": datetime.now(UTC).isoformat(),
            "workdir": str(self.workdir),  # removed at the end; release removes it when the task died first
            "workers": [{"rank": w.rank, "host": w.host, "port": w.port, "gpus": list(w.devices or []),
                         **w.record} for w in workers],
        }
        with self.storage():
            write_json_atomic(self.state_url, record)
        if self.on_record:
            self.on_record(record)

    def _finish(self, state: GroupState, result: RunResult | None, *, failing: bool) -> None:
        """Final state record and log upload. When the group is already failing, a storage error here is logged so
        that it does not hide the workers' error; after a success it raises (artifacts complete or absent)."""
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
