"""Which process supervises the running Airflow task, so a worker group can stop when that process is gone.

Airflow 3 runs a task in a task-runner process forked by a supervisor (the LocalExecutor's worker, a Celery pool
child). When the supervisor is killed outright (SIGKILL, the OOM killer), the scheduler fails the task at once, but
the task runner is only re-parented and runs on: its launcher would keep the workers training beside the retry.
`airflow dags test` runs the task in its own process, with no supervisor to lose.
"""

from __future__ import annotations

import os


def task_supervisor_pid() -> int | None:
    """The pid of this task's supervisor, None when the task runs in-process (`airflow dags test`) or outside
    Airflow. Call it from the task itself: the supervisor is the task runner's parent."""
    from airflow.sdk.execution_time import task_runner
    from airflow.sdk.execution_time.supervisor import InProcessSupervisorComms

    comms = getattr(task_runner, "SUPERVISOR_COMMS", None)
    if comms is None or isinstance(comms, InProcessSupervisorComms):
        return None
    return os.getppid()
