"""GPU admission: tasks that use GPUs queue for slots of the `gpu_slots` pool, one slot per GPU, and run on the
Celery queue that the GPU hosts' workers serve.

Whether a task uses GPUs, and how many, depends on the run's settings (`use_gpu`, `num_workers`: its `RunConfig`,
built from the trigger's conf over the Param defaults), but Airflow fixes a task instance's `pool` and `pool_slots`
when it creates it and does not template them. So a cluster policy sets them: `task_instance_mutation_hook` runs in
the scheduler, the API server and `airflow dags test` whenever a task instance is created or cleared, with the run at
hand. It is registered by
`plugins/airflow_local_settings.py`, which Airflow imports in every component.

A task opts in by declaring `pool=GPU_POOL` in the DAG. Its GPUs are one per worker: a worker group with a fixed
`num_workers` takes that many, one without (`None`: it follows the run's configuration) takes the run's
`num_workers`, as does a plain Python task that launches a group of the run's workers (`RUN_GROUP_TASKS`: evaluate,
which scores each model on every worker of the run); any other task without workers takes one. Runs without
`use_gpu` move such tasks to the default pool, so CPU runs never need `gpu_slots`.

The same tasks go to the run's `gpu_queue` (a Celery queue; empty: the task's own queue), whatever `use_gpu`: they
launch and watch the workers, and the `local` backend starts them on the Airflow worker's own host. Release
(`tasks.queues.HOST_TASKS`) follows them there without holding a slot: it ends and checks the processes and GPUs of
its own host, and reports a local group launched on another host as unverified. Queues matter
only to the CeleryExecutor (and the Kubernetes executor's queue routing); pools are counted in the scheduler, so
`gpu_slots` sized to what the GPU queues can run at once keeps tasks waiting there, never in the broker (a task
queued in the broker longer than `[scheduler] task_queued_timeout` fails).
"""

from __future__ import annotations

import logging
import os
import socket
from typing import TYPE_CHECKING, Any

from core.config import ConfigError, RunConfig
from launcher.host_probe import NvmlUnavailable, nvml
from tasks.queues import HOST_TASKS

if TYPE_CHECKING:
    from airflow.models.dagrun import DagRun
    from airflow.models.taskinstance import TaskInstance

log = logging.getLogger(__name__)

GPU_POOL = "gpu_slots"
DEFAULT_POOL = "default_pool"  # airflow.models.pool.Pool.DEFAULT_POOL_NAME, without importing the ORM at start-up
SLOTS_SETTING = "GPT_FINETUNE_GPU_SLOTS"
POOL_DESCRIPTION = "GPUs on the training hosts: one slot per worker"
# Plain Python tasks that launch groups of the run's `num_workers` (tasks/evaluate.py's evaluations).
RUN_GROUP_TASKS = frozenset({"evaluate"})


def run_config(task: Any, dag_run: DagRun) -> RunConfig | None:
    """The run's config as its first task will build it: the trigger's conf over the DAG's Param defaults (no access
    policy: the scheduler only routes). None when the conf is refused: prepare fails the run, naming the setting."""
    params = getattr(task, "params", None)
    defaults = params.dump() if hasattr(params, "dump") else dict(params or {})
    try:
        return RunConfig.of(**{**defaults, **(dag_run.conf or {})})
    except ConfigError as error:
        log.info("Run %s: its settings are refused (%s); its GPU tasks hold one slot until prepare fails it.",
                 dag_run.run_id, error)
        return None


def gpus_needed(task: Any, cfg: RunConfig | None) -> int:
    """GPUs a task of `gpu_slots` holds in a run with this config; 0 on the CPU, 1 for a refused config."""
    if cfg is None:
        return 1
    if not cfg.use_gpu:
        return 0
    if getattr(task, "run_config", None) is None and getattr(task, "task_id", None) not in RUN_GROUP_TASKS:
        return 1  # a plain Python task, no worker group
    # A worker group's own count (the baseline's 1), else the run's (the scheduler sees only template fields).
    return getattr(task, "num_workers", None) or cfg.num_workers


def _pool_size(dag_run: DagRun) -> int | None:
    """Slots of `gpu_slots` read through the run's own session (the hook may not open one); None if unknown."""
    from airflow.models.pool import Pool
    from sqlalchemy import select
    from sqlalchemy.orm import object_session

    session = object_session(dag_run)
    if session is None:
        return None
    with session.no_autoflush:
        slots = session.scalar(select(Pool.slots).where(Pool.pool == GPU_POOL))
    if slots is None:
        log.warning("Pool %r does not exist: the scheduler starts no GPU task of run %s until it does (`airflow "
                    "dags test` ignores pools). Create it with `airflow pools set %s <GPUs> ...`, or set %s "
                    "(make airflow) / GPU_SLOTS (docker compose) and restart.",
                    GPU_POOL, dag_run.run_id, GPU_POOL, SLOTS_SETTING)
    return slots


def gpu_queue(task: Any, cfg: RunConfig | None) -> str:
    """The queue a GPU task of this run goes to: the run's `gpu_queue`, else the task's own (also for a refused
    config: the run's first task refuses it, naming the setting)."""
    return (cfg.launch.gpu_queue if cfg else "") or task.queue


def task_instance_mutation_hook(task_instance: TaskInstance, dag_run: DagRun | None) -> None:
    task = getattr(task_instance, "task", None)
    if dag_run is None or task is None:
        return  # not bound to a run yet: the hook runs again once it is
    if task.pool != GPU_POOL and task.task_id not in HOST_TASKS:
        return  # not a GPU task
    cfg = run_config(task, dag_run)
    task_instance.queue = gpu_queue(task, cfg)
    if task.pool != GPU_POOL:
        return  # a host task: where the groups ran, no GPU slot
    gpus = gpus_needed(task, cfg)
    if gpus == 0:
        task_instance.pool, task_instance.pool_slots = DEFAULT_POOL, 1
        return
    pool_size = _pool_size(dag_run)
    if pool_size is not None and 0 < pool_size < gpus:
        # A request above the pool's total would wait forever; holding the whole pool lets the task run alone
        # and its own GPU check (preflight, the launcher) report what is missing.
        log.warning("%s of run %s needs %d GPUs but pool %r has %d slots: it takes the whole pool. Raise %s "
                    "(or GPU_SLOTS) if the hosts have more GPUs.", task_instance.task_id, dag_run.run_id, gpus,
                    GPU_POOL, pool_size, SLOTS_SETTING)
        gpus = pool_size
    task_instance.pool, task_instance.pool_slots = GPU_POOL, gpus


def configured_pool_size() -> int | None:
    """GPT_FINETUNE_GPU_SLOTS as an integer >= 1; None when unset."""
    value = os.environ.get(SLOTS_SETTING, "").strip()
    if not value:
        return None
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"{SLOTS_SETTING}={value!r}: expected the number of GPUs the runs may use (an integer >= 1)")
    return int(value)


def detected_gpus() -> int:
    """GPUs NVML sees on this host; 0 without NVML, or when NVML starts but cannot count them (the pool then gets
    one slot, and a `use_gpu` run fails in preflight naming the GPUs it lacks, instead of the scheduler failing)."""
    try:
        with nvml() as pynvml:
            try:
                return pynvml.nvmlDeviceGetCount()
            except pynvml.NVMLError as error:
                log.warning("NVML on %s started but could not count its GPUs (%s): none counted; set %s to size "
                            "the pool by hand", socket.gethostname(), error, SLOTS_SETTING)
                return 0
    except NvmlUnavailable as reason:
        log.info("NVML unavailable (%s): no GPUs visible", reason)
        return 0


def ensure_gpu_pool() -> tuple[int, str]:
    """Create or resize `gpu_slots` at start-up; returns (slots, what was done).

    GPT_FINETUNE_GPU_SLOTS sets the size every start. Unset, an existing pool keeps its size (it may have been
    changed in the UI) and a missing one gets the GPUs NVML sees, at least one, so that a `use_gpu` run on a host
    without GPUs reaches preflight and fails there, naming the missing GPUs, instead of waiting for slots forever.
    """
    from airflow.models.pool import Pool
    from airflow.utils.session import create_session

    configured = configured_pool_size()
    with create_session() as session:
        existing = Pool.get_pool(GPU_POOL, session=session)
        if configured is None and existing is not None:
            return existing.slots, "kept"
        slots = configured if configured is not None else max(1, detected_gpus())
        Pool.create_or_update_pool(GPU_POOL, slots, POOL_DESCRIPTION, include_deferred=False, session=session)
    return slots, "set from " + (SLOTS_SETTING if configured is not None else "the GPUs NVML sees (at least 1)")
