"""Where the GPU tasks will run: the run's `gpu_queue`, and whether any Celery worker serves it now.

A task sent to a queue that no worker consumes waits in the broker, silently, until `[scheduler]
task_queued_timeout` fails it, and its own log stays empty all that time. So the prepare task, which runs first,
asks the Celery workers which queues they consume and says it in its log while the run can still be fixed.
"""

from __future__ import annotations

import logging

from core.config import RunConfig

log = logging.getLogger("gpt_finetune.queues")

GPU_TASKS = ("preflight", "train", "baseline", "evaluate")
# Tasks that follow the GPU tasks to their queue without holding GPUs: release ends and checks the processes, work
# directories and GPUs of its own host, so it must run where the local backend's groups ran.
HOST_TASKS = ("release",)
INSPECT_TIMEOUT_S = 3.0


def served_queues(timeout_s: float = INSPECT_TIMEOUT_S) -> dict[str, list[str]] | None:
    """Celery worker name -> the queues it consumes, from the workers that answer within `timeout_s`; None when
    this deployment does not run the CeleryExecutor (queues then mean nothing)."""
    from airflow.configuration import conf

    if "celery" not in conf.get("core", "executor", fallback="").lower():
        return None
    from airflow.providers.celery.executors.celery_executor import app

    answers = app.control.inspect(timeout=timeout_s).active_queues() or {}
    return {worker: sorted(queue["name"] for queue in queues) for worker, queues in answers.items()}


def report_gpu_queue(cfg: RunConfig) -> None:
    """Log the queue of the GPU tasks; warn, naming the queue and the command, when no worker serves it."""
    if not cfg.launch.gpu_queue:
        return
    try:
        workers = served_queues()
    except Exception as error:  # noqa: BLE001 - a broker that does not answer must not fail the run
        log.warning("Could not ask the Celery workers which queues they serve (%s: %s); %s will wait for a worker "
                    "of queue %r.", type(error).__name__, error, ", ".join(GPU_TASKS), cfg.launch.gpu_queue)
        return
    if workers is None:
        log.info("gpu_queue=%r: this deployment's executor does not use Celery queues, so it has no effect.",
                 cfg.launch.gpu_queue)
        return
    serving = sorted(worker for worker, queues in workers.items() if cfg.launch.gpu_queue in queues)
    if serving:
        log.info("%s run on queue %r, served by %s.", ", ".join(GPU_TASKS + HOST_TASKS), cfg.launch.gpu_queue,
                 ", ".join(serving))
        if len(serving) > 1:
            log.warning(
                "Queue %r is served by %d workers (%s): this run's groups may run on different hosts, and release "
                "can check only the host it runs on (a group of another host is reported unverified, and the run "
                "not released). Give each GPU host a queue of its own (`airflow celery worker -q %s,%s-<host>`) "
                "and trigger with gpu_queue=%s-<host>.", cfg.launch.gpu_queue, len(serving), ", ".join(serving),
                cfg.launch.gpu_queue, cfg.launch.gpu_queue, cfg.launch.gpu_queue)
    else:
        log.warning(
            "No Celery worker serves queue %r now (workers answering: %s). %s will wait in that queue until one "
            "does, and fail after [scheduler] task_queued_timeout (a run stopped meanwhile still waits for its "
            "release there: mark release skipped if nothing ran): start `airflow celery worker -q %s` on each GPU "
            "host, or trigger with another gpu_queue.", cfg.launch.gpu_queue,
            "; ".join(f"{worker} ({', '.join(queues)})" for worker, queues in sorted(workers.items())) or "none",
            ", ".join(GPU_TASKS + HOST_TASKS), cfg.launch.gpu_queue)
