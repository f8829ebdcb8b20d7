"""gpt_finetune on the production topology (tests/support/celery_stack.py: Postgres, Redis, CeleryExecutor, every
Airflow component its own process, a worker for queue `default` and one for queue `gpu`): the GPU-slot tasks run on the
gpu worker and the rest on the default one; a scheduler killed and restarted mid-training does not touch the run; the
Celery pool child running train SIGKILLed (the OOM killer) leaves no worker alive 10 s later, and the retry resumes from
the checkpoint without ever running beside the earlier group; release follows the GPU tasks to the gpu worker and
checks the same host identity (host, boot, PID and mount namespaces) that train's group recorded; train marked failed
ends every worker within 10 s; a gpu_queue no worker serves is named in prepare's log.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

import pytest

from core.layout import StorageLayout, run_key
from tasks.release import processes_of_run
from tests.e2e.runs import DAG, FAST, LONG, assert_released, run_path, task_runner_pid, trigger, wait_until
from tests.e2e.runs import worker_ranks as trainer_ranks

pytestmark = pytest.mark.timeout(1200)

GPU_QUEUE = "gpu"
GPU_TASKS = {"preflight", "train", "baseline", "evaluate"}
ON_GPU_QUEUE = GPU_TASKS | {"release"}  # release checks the host where the groups ran


def assert_release_checked_the_group_s_host(stack, key: str) -> dict:
    """Release ran where train's group ran (the identity the launcher recorded), so it checked, not assumed."""
    run = StorageLayout(stack.env["GPT_FINETUNE_STORAGE_ROOT"]).run(key)
    group = json.loads(Path(run.state_file("train")).read_text())
    release = json.loads(Path(run.release).read_text())
    assert group["backend"] == "local" and group["launcher"]["hostname"]
    assert release["host_identity"] == group["launcher"], (release["host_identity"], group["launcher"])
    assert release["unverified_records"] == [] and release["clean"] is True
    print(f"train's group and release on the same host identity: {group['launcher']}")
    return release


def task_instances(stack, run_id: str) -> dict[str, dict]:
    page = stack.rest("GET", f"{run_path(run_id)}/taskInstances?limit=100")
    return {row["task_id"]: row for row in page["task_instances"] if row["state"] not in ("skipped", None)}


def parent(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


class TrainerWatch:
    """Every trainer pid of a run seen alive, sampled every 50 ms, and whether two groups ever ran at once."""

    def __init__(self, key: str) -> None:
        self.key, self.stop = key, threading.Event()
        self.seen: set[int] = set()
        self.overlaps: list[set[int]] = []
        self.first_group: set[int] = set()
        self.error: BaseException | None = None  # what ended the sampling early, if anything did
        self.thread = threading.Thread(target=self._sample, daemon=True)

    def start(self, first_group: set[int]) -> TrainerWatch:
        self.first_group = set(first_group)
        self.thread.start()
        return self

    def _sample(self) -> None:
        try:
            while not self.stop.is_set():
                alive = set(trainer_ranks(self.key).values())
                if alive & self.first_group and alive - self.first_group:
                    self.overlaps.append(alive)
                self.seen |= alive
                time.sleep(0.05)
        except BaseException as error:  # noqa: BLE001 - reported by the test, not lost with the thread
            self.error = error


def test_gpu_tasks_on_the_gpu_queue_a_scheduler_restart_and_a_sigkilled_pool_child(celery_stack):
    stack = celery_stack
    run_id = trigger(stack, {**LONG, "gpu_queue": GPU_QUEUE})
    key = run_key(DAG, run_id)
    train = StorageLayout(stack.env["GPT_FINETUNE_STORAGE_ROOT"]).run(key).train
    wait_until(lambda: len(trainer_ranks(key)) == 2, 400, "both trainer workers of attempt 1")

    stack.kill_component("scheduler")  # Celery keeps the task running; the new scheduler adopts it
    restart_s = stack.restart_component("scheduler")
    print(f"\nscheduler SIGKILLed and restarted in {restart_s:.1f} s mid-training")
    wait_until(lambda: Path(train.checkpoints, "checkpoint").exists(), 400, "a checkpoint of attempt 1")
    first_group = set(trainer_ranks(key).values())
    assert len(first_group) == 2, "training did not survive the scheduler restart"

    watch = TrainerWatch(key).start(first_group)
    supervisor = parent(task_runner_pid(stack, run_id, "train"))  # the Celery pool child supervising train
    os.kill(supervisor, signal.SIGKILL)
    killed = time.monotonic()
    wait_until(lambda: not set(trainer_ranks(key).values()) & first_group, 10,
               "attempt 1's workers gone after SIGKILL of its pool child", 0.1)
    print(f"pool child of train SIGKILLed: attempt 1's workers gone after {time.monotonic() - killed:.1f} s")

    assert stack.wait_for_run(DAG, run_id, timeout=900) == "success"
    watch.stop.set()
    watch.thread.join()
    assert watch.error is None, f"the watch stopped sampling: {watch.error!r}"
    assert watch.overlaps == [], f"the retry ran beside attempt 1's workers: {watch.overlaps}"
    assert watch.seen - first_group, "the retry's workers were never seen"
    assert "resuming" in stack.task_log(DAG, run_id, "train", try_number=2)
    summary = json.loads(Path(train.summary).read_text())
    assert summary["resumed_from_step"] >= LONG["checkpoint_every_steps"] and summary["steps"] == LONG["max_steps"]

    instances = task_instances(stack, run_id)
    gpu, default = stack.worker_hostname(GPU_QUEUE), stack.worker_hostname("default")
    for task_id, instance in instances.items():
        expected = (GPU_QUEUE, gpu) if task_id in ON_GPU_QUEUE else ("default", default)
        assert (instance["queue"], instance["hostname"]) == expected, (task_id, instance)
    assert ON_GPU_QUEUE - {"baseline"} <= set(instances)  # LONG skips the baseline
    assert_released(stack, run_id)
    assert_release_checked_the_group_s_host(stack, key)


def test_marking_train_failed_ends_every_worker_within_10_seconds(celery_stack):
    stack = celery_stack
    run_id = trigger(stack, {**LONG, "gpu_queue": GPU_QUEUE})
    key = run_key(DAG, run_id)
    wait_until(lambda: len(trainer_ranks(key)) == 2, 400, "both trainer workers")
    stack.rest("PATCH", f"{run_path(run_id)}/taskInstances/train", {"new_state": "failed"})
    marked = time.monotonic()
    wait_until(lambda: not processes_of_run(key), 10, "every worker gone after train was marked failed", 0.1)
    print(f"\ntrain marked failed on Celery: every worker gone after {time.monotonic() - marked:.1f} s")
    assert stack.wait_for_run(DAG, run_id, timeout=300) == "failed"
    assert stack.task_states(DAG, run_id)["release"] == "success"
    release = task_instances(stack, run_id)["release"]
    assert (release["queue"], release["hostname"]) == (GPU_QUEUE, stack.worker_hostname(GPU_QUEUE)), release
    assert_release_checked_the_group_s_host(stack, key)


def test_a_gpu_queue_no_worker_serves_is_named_in_the_prepare_log(celery_stack):
    stack = celery_stack
    run_id = trigger(stack, {**FAST, "gpu_queue": "nowhere"})
    wait_until(lambda: stack.task_states(DAG, run_id).get("publish") == "success", 300, "the prepare steps")
    log = stack.task_log(DAG, run_id, "prepare")
    assert "No Celery worker serves queue 'nowhere' now" in log and "airflow celery worker -q nowhere" in log
    time.sleep(5)
    assert stack.task_states(DAG, run_id)["preflight"] in ("queued", "scheduled"), "a task ran on no worker"
    stack.rest("PATCH", run_path(run_id), {"state": "failed"})
    # Release follows the GPU tasks to their queue, so it waits there too (it never runs on another host than
    # theirs); nothing ran on a GPU host, so the stopped run ends once it is marked skipped.
    wait_until(lambda: stack.task_states(DAG, run_id).get("release") in ("queued", "scheduled"), 120,
               "release waiting in the unserved queue")
    time.sleep(3)
    assert stack.task_states(DAG, run_id)["release"] in ("queued", "scheduled"), "release ran on another queue"
    assert task_instances(stack, run_id)["release"]["queue"] == "nowhere"
    stack.rest("PATCH", f"{run_path(run_id)}/taskInstances/release", {"new_state": "skipped"})
    assert stack.wait_for_run(DAG, run_id, timeout=300) == "failed"
