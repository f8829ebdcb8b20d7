"""Release as soon as training ends, proven (issue 40, item 6): right after a group exits, the one launch path
(tasks/launch.py) asks the backend to prove that the group's slots are free, and records `release_after_train_s`.

The local backend uses release's bounded NVML evidence (launcher/gpus.py), here on the fake NVML with the measured
0.1 s lag of a process leaving NVML's list; on CPU a slot is (host, rank), free once the rank's processes are gone.
Workers are the tiny stand-ins of tests/launcher/entrypoints (no TensorFlow).
"""

from __future__ import annotations

import re

from core.layout import StorageLayout
from core.storage import read_json
from launcher import GroupSpec, LocalBackend
from launcher.gpus import GPU_RELEASE_WAIT_S, Polling, check_exited_slots
from tasks.evaluate import with_release_after_train
from tasks.launch import RecordedLaunch
from tasks.report.parts import run_view
from tasks.report.store import render_markdown
from tests.launcher.conftest import entrypoint_env
from tests.launcher.test_gpus import Clock
from tests.support.fake_nvml import GIB, FakeNvml, h200s, install
from tests.tasks.report.test_store import document

STARTING = re.compile(r"^rank (\d+) of \d+ pid (\d+) ")


def _launch(tmp_path, *, use_gpu: bool, on_line=lambda rank, line: None) -> tuple[RecordedLaunch, object]:
    run = StorageLayout(str(tmp_path / "storage")).run("slots-free-run")
    spec = GroupSpec(name="train", entrypoint="tiny_worker", num_workers=2, use_gpu=use_gpu, run_key="slots-free-run",
                     env=entrypoint_env(TINY_WORKER_STEPS="3"), startup_timeout_s=60, hang_timeout_s=60,
                     grace_period_s=2)
    return RecordedLaunch(spec, LocalBackend(), run, on_line=on_line), run


def test_a_groups_gpus_are_proven_free_right_after_it_exits(monkeypatch, tmp_path):
    fake = install(monkeypatch, FakeNvml(h200s(2), list_lag_s=0.1))

    def hold_a_gpu(rank: int, line: str) -> None:  # each worker "uses" its GPU until it exits
        started = STARTING.match(line)
        if started:
            fake.attach(int(started[2]), int(started[1]), 8 * GIB)

    launch, run = _launch(tmp_path, use_gpu=True, on_line=hold_a_gpu)
    result = launch.run_group()
    assert result.succeeded, result.error_message()
    check = launch.after_exit.to_json()
    assert check["checked"] is True and check["free"] is True and check["slots"] == "gpu", check
    # NVML listed the exited workers for another 0.1 s: the proof waited for it, and no longer than needed.
    assert 0.1 <= check["release_after_train_s"] < 2.0, check
    assert check["gpu_check"]["held_by_run"] == [] and check["gpu_check"]["unverified"] == []
    assert len(fake.processes) == 2 and all(not device["pids"] for device in check["gpu_check"]["devices"])

    record = read_json(run.state_file("train"))  # the run's state record keeps it for release and the report
    # Each rank's GPU idle level as its placement read it (the measured H200's 615 MiB, no process on it).
    assert sorted(list(w["gpu_idle_mb"].items()) for w in record["workers"]) == [[(g.uuid, 615)] for g in fake.gpus]
    assert record["after_exit"]["release_after_train_s"] == check["release_after_train_s"]
    report = with_release_after_train(document(baseline=False), run)
    assert report.runs.distributed.release_after_train_s == check["release_after_train_s"]
    markdown = render_markdown(run_view(report, None, None))
    assert (f"Released after training: the workers' slots were proven free distributed "
            f"{check['release_after_train_s']:.2f} s after they exited") in markdown


def test_cpu_slots_are_free_once_the_ranks_processes_are_gone(tmp_path):
    launch, _ = _launch(tmp_path, use_gpu=False)
    assert launch.run_group().succeeded
    check = launch.after_exit.to_json()
    assert check["slots"] == "cpu" and check["free"] is True and check["processes_left"] == [], check
    assert 0 <= check["release_after_train_s"] < 1.0


def test_a_gpu_that_stays_held_is_not_proven_free_and_the_wait_is_bounded(monkeypatch):
    clock = Clock()
    fake = install(monkeypatch, FakeNvml(h200s(2), clock=clock))
    fake.start_process(1, 8 * GIB, pid=4242)  # the run's pid never leaves GPU 1's list
    check = check_exited_slots({4241, 4242}, [fake.gpus[0].uuid, fake.gpus[1].uuid], use_gpu=True, alive=list,
                               polling=Polling(clock=clock, sleep=clock.sleep))
    assert check["free"] is False and check["free_after_s"] is None
    assert check["gpu_check"]["held_by_run"] == [{"gpu": 1, "uuid": fake.gpus[1].uuid, "pid": 4242}]
    assert GPU_RELEASE_WAIT_S <= clock.now < GPU_RELEASE_WAIT_S + 1


def test_a_gpu_whose_memory_stays_above_its_recorded_idle_level_is_not_proven_free(monkeypatch):
    clock = Clock()
    fake = install(monkeypatch, FakeNvml(h200s(1), clock=clock))
    fake.start_process(0, 8 * GIB, pid=4242)
    fake.start_process(0, 1 * GIB, listed_pid=None)  # left in use by no listed process
    fake.end_process(4242)
    uuid = fake.gpus[0].uuid
    check = check_exited_slots({4242}, [uuid], use_gpu=True, alive=list, idle_mb={uuid: 615},
                               polling=Polling(wait_s=1.0, clock=clock, sleep=clock.sleep))
    assert check["free"] is False and check["gpu_check"]["held_by_run"] == []
    (entry,) = check["gpu_check"]["unverified"]
    assert "1639 MiB are in use by no listed process" in entry["reason"]  # 615 idle + 1024
    assert "recorded at placement, is 615 MiB" in entry["reason"]
