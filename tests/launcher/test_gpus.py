"""launcher/gpus.py and the local backend's use of it, on the fake NVML (tests/support/fake_nvml.py): release waits
for the run's pids to leave (the measured 0.09-0.12 s lag), memory in use by another PID namespace keeps a GPU out,
pids that match no process here make release "unverified", one GPU's NVML error never fails the others, workers
are pinned by UUID, and a relaunch waits for the GPUs its stopped ranks held."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import uuid

import pytest

from launcher import GroupSpec, InsufficientGPUsError, LocalBackend, tensorflow_env
from launcher.gpus import (
    GPU_RELEASE_WAIT_S,
    IDLE_USED_MB_ENV,
    ReleaseWatch,
    probe_gpus,
    release_check,
    release_is_clean,
)
from launcher.protocol import GROUP_ENV, RUN_KEY_ENV
from launcher.state_record import RecordedWorker, StateRecord
from tests.launcher.conftest import alive
from tests.support import fake_nvml
from tests.support.fake_nvml import GIB, FakeNvml, h200s, install


class Clock:
    """A clock that moves only when the code under test sleeps."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


def _check(watch: ReleaseWatch, clock: Clock, **kwargs) -> dict:
    return release_check(watch, clock=clock, sleep=clock.sleep, here=lambda pid: False, **kwargs)


def _group(num_workers: int, use_gpu: bool = True) -> GroupSpec:
    return GroupSpec(name="train", entrypoint="trainer.train", num_workers=num_workers, use_gpu=use_gpu)


# -- release: issue 38 item 2(a) -----------------------------------------------------------------------------------

def test_a_killed_pid_still_listed_for_a_tenth_of_a_second_then_gone_gives_clean(monkeypatch):
    """The measured case (H200, driver 580): NVML lists a SIGKILLed worker ~0.1 s after the signal."""
    clock = Clock()
    fake = install(monkeypatch, FakeNvml(h200s(2), list_lag_s=0.1, clock=clock))
    fake.start_process(1, 8 * GIB, pid=4242)
    fake.end_process(4242)  # release's stop ladder just killed it
    check = _check(ReleaseWatch(frozenset({4242}), held=frozenset({1})), clock)
    assert check["held_by_run"] == [] and check["unverified"] == []
    assert 0.1 <= check["free_after_s"] < 0.2
    assert [device["pids"] for device in check["devices"]] == [[], []]


def test_a_pid_that_never_leaves_is_held_by_run_after_the_bounded_wait(monkeypatch):
    clock = Clock()
    fake = install(monkeypatch, FakeNvml(h200s(2), clock=clock))
    gpus = fake.gpus
    fake.start_process(0, 8 * GIB, pid=4242)
    check = _check(ReleaseWatch(frozenset({4242}), held=frozenset({0})), clock)
    assert check["held_by_run"] == [{"gpu": 0, "uuid": gpus[0].uuid, "pid": 4242}]
    assert check["free_after_s"] is None and clock.now >= GPU_RELEASE_WAIT_S


def test_release_of_a_worker_that_ignores_sigterm_waits_for_nvml_and_reports_clean(monkeypatch, tmp_path):
    """LocalBackend.release end to end: TERM, grace, KILL of a real process, then NVML's lag, then clean."""
    key = f"run-{uuid.uuid4().hex[:8]}"
    stubborn = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('ready', flush=True); " \
               "time.sleep(600)"
    worker = subprocess.Popen([sys.executable, "-c", stubborn],
                              env={**os.environ, RUN_KEY_ENV: key}, stdout=subprocess.PIPE, text=True)
    assert worker.stdout.readline().strip() == "ready"
    fake = install(monkeypatch, FakeNvml(h200s(1), list_lag_s=0.1))
    fake.attach(worker.pid, 0, 8 * GIB)
    try:
        recorded = RecordedWorker(0, "localhost", None, (fake.gpus[0].uuid,), extra={"pid": worker.pid})
        record = StateRecord("train", "local", "running", "2026-12-05T07:00:00.000Z", "", workers=(recorded,))
        released = LocalBackend().release(key, [record], grace_s=0.3)
    finally:
        worker.kill()
        worker.wait()
    host = released.hosts[0].entry()
    assert host["killed"] == [worker.pid] and released.clean is True, released
    assert host["gpu_check"]["held_by_run"] == [] and host["gpu_check"]["free_after_s"] >= 0.05
    assert not alive(worker.pid)


# -- admission and release across PID namespaces: item 2(b) -------------------------------------------------------

def test_a_gpu_whose_memory_another_namespace_uses_is_not_free(monkeypatch):
    """Drivers >= 570 drop another namespace's process from the list; its memory stays in use (review section 3)."""
    fake = install(monkeypatch, FakeNvml(h200s(2)))
    fake.start_process(1, 40 * GIB, listed_pid=None)
    gpus = probe_gpus()
    assert gpus.free_indices == [0]
    (busy, reason), = gpus.left_out
    assert busy.index == 1 and "40961 MiB" in reason and "another PID namespace" in reason
    with pytest.raises(InsufficientGPUsError, match=rf"host {socket.gethostname()} has 1 free GPU.*GPU 1 "
                                                    rf"\({fake.gpus[1].uuid}\).*another PID namespace"):
        LocalBackend().place(_group(2))


def test_the_idle_level_is_a_setting(monkeypatch):
    fake = install(monkeypatch, FakeNvml(h200s(1)))
    fake.start_process(0, 600 << 20, listed_pid=None)
    assert probe_gpus().free_indices == []
    assert probe_gpus({IDLE_USED_MB_ENV: "1024"}).free_indices == [0]


@pytest.mark.parametrize("freed_at", [0.4, None])
def test_a_gpu_the_run_held_counts_as_released_only_when_its_memory_comes_back(monkeypatch, freed_at):
    """The run's pid leaves the list at 0.1 s, but the memory it held (a context torn down late, or a child in
    another namespace) comes back only at `freed_at`, or never."""
    clock = Clock()
    fake = install(monkeypatch, FakeNvml(h200s(1), clock=clock))
    fake.start_process(0, 8 * GIB, pid=4242)
    held_on = fake.start_process(0, 8 * GIB, listed_pid=None)
    fake.end_process(4242)
    if freed_at is not None:
        held_on.ended_at = freed_at - fake.list_lag_s
    check = _check(ReleaseWatch(frozenset({4242}), held=frozenset({0})), clock, wait_s=2.0)
    assert check["held_by_run"] == []
    if freed_at is None:
        assert check["free_after_s"] is None and [u["gpu"] for u in check["unverified"]] == [0]
        assert "8193 MiB are still in use by no listed process" in check["unverified"][0]["reason"]
    else:
        assert check["unverified"] == [] and freed_at <= check["free_after_s"] < freed_at + 0.1


def test_host_pids_that_match_no_process_here_make_release_unverified_never_clean(monkeypatch):
    """Older drivers list host pids inside a container: the run's pids cannot be matched (review section 3)."""
    clock = Clock()
    fake = install(monkeypatch, FakeNvml(h200s(2), clock=clock, driver="515.43.04"))
    fake.start_process(0, 8 * GIB, pid=77, listed_pid=3190442)  # pid 77 here is pid 3190442 on the host
    check = _check(ReleaseWatch(frozenset({77})), clock)
    assert check["held_by_run"] == []
    assert [(u["gpu"], u["uuid"]) for u in check["unverified"]] == [(0, fake.gpus[0].uuid)]
    assert "[3190442]" in check["unverified"][0]["reason"] and "PID namespace" in check["unverified"][0]["reason"]
    assert release_is_clean(check) is False


# -- NVML errors after start-up: item 3 ----------------------------------------------------------------------------

def _broken_host(monkeypatch) -> FakeNvml:
    gpus = h200s(4)
    gpus[1].errors["nvmlDeviceGetHandleByIndex"] = fake_nvml.NVML_ERROR_NO_PERMISSION
    gpus[3].errors["nvmlDeviceGetComputeRunningProcesses"] = fake_nvml.NVML_ERROR_NO_PERMISSION  # MIG, unprivileged
    fake = install(monkeypatch, FakeNvml(gpus))
    fake.lose(2)
    return fake


def test_placement_leaves_out_a_gpu_nvml_cannot_read_and_names_it(monkeypatch):
    fake = _broken_host(monkeypatch)
    placed = LocalBackend().place(_group(1))
    assert [p.devices for p in placed] == [(fake.gpus[0].uuid,)]
    with pytest.raises(InsufficientGPUsError) as refused:
        LocalBackend().place(_group(2))
    message = str(refused.value)
    assert f"host {socket.gethostname()} has 1 free GPU(s) [0]" in message
    assert "GPU 1: NVML cannot read it (NVMLError_NoPermission: Insufficient Permissions)" in message
    assert "GPU 2: NVML cannot read it (NVMLError_GpuIsLost: GPU is lost)" in message  # a lost GPU has no UUID
    assert f"GPU 3 ({fake.gpus[3].uuid}): NVML cannot read it (NVMLError_NoPermission" in message
    assert "left out" in LocalBackend().capacity(_group(4)).reasons[0]


def test_release_reports_a_lost_gpu_the_run_used_and_ignores_one_it_did_not(monkeypatch):
    clock = Clock()
    fake = _broken_host(monkeypatch)
    fake.clock = clock
    on_lost = _check(ReleaseWatch(frozenset({4242}), placed_on=frozenset({fake.gpus[2].uuid})), clock)
    # The run's GPU answers no UUID any more: either unreadable GPU without one (1, 2) may be it; GPU 3 is not.
    assert [(u["gpu"], "GPU is lost" in u["reason"]) for u in on_lost["unverified"]] == [(1, False), (2, True)]
    assert [d.get("error", "").partition(":")[0] for d in on_lost["devices"]] == [
        "", "NVMLError_NoPermission", "NVMLError_GpuIsLost", "NVMLError_NoPermission"]
    elsewhere = _check(ReleaseWatch(frozenset({4242}), placed_on=frozenset({fake.gpus[0].uuid})), clock)
    assert elsewhere["unverified"] == [] and elsewhere["held_by_run"] == []


def test_use_gpu_without_nvml_names_the_host_and_the_cause(monkeypatch):
    install(monkeypatch, FakeNvml(h200s(1), init_error=fake_nvml.NVML_ERROR_DRIVER_NOT_LOADED))
    with pytest.raises(InsufficientGPUsError, match=rf"NVML is unavailable on host {socket.gethostname()} "
                                                    r"\(Driver Not Loaded\).*set use_gpu to false"):
        LocalBackend().place(_group(1))
    monkeypatch.setitem(sys.modules, "pynvml", None)
    with pytest.raises(InsufficientGPUsError, match=r"unavailable on host .* \(nvidia-ml-py not installed\)"):
        LocalBackend().place(_group(1))


# -- devices by UUID: item 5 ---------------------------------------------------------------------------------------

def test_workers_are_pinned_by_uuid_and_records_keep_the_index(monkeypatch):
    fake = install(monkeypatch, FakeNvml(h200s(3)))
    fake.start_process(0, 8 * GIB)
    placements = LocalBackend().place(_group(2))
    assert [p.devices for p in placements] == [(fake.gpus[1].uuid,), (fake.gpus[2].uuid,)]
    assert [p.where for p in placements] == [{"gpu": "1"}, {"gpu": "2"}]
    assert tensorflow_env(placements, 1)["CUDA_VISIBLE_DEVICES"] == fake.gpus[2].uuid


# -- order and timing: item 4 --------------------------------------------------------------------------------------

def test_a_relaunch_waits_for_the_gpus_its_stopped_ranks_held(monkeypatch):
    clock = Clock()
    fake = install(monkeypatch, FakeNvml(h200s(2), clock=clock, list_lag_s=0.3))
    for pid in (501, 502):
        fake.start_process(pid - 501, 8 * GIB, pid=pid)
    backend = LocalBackend(clock=clock, sleep=clock.sleep)
    with pytest.raises(InsufficientGPUsError):  # nothing stopped here: no waiting for GPUs others use
        backend.place(_group(2))
    assert clock.now == 0
    for pid in (501, 502):
        fake.end_process(pid)  # the attempt's ranks were stopped (port-bind failure)
    backend.end_group(_group(2))
    assert [p.devices for p in backend.place(_group(2))] == [(gpu.uuid,) for gpu in fake.gpus]
    assert 0.3 <= clock.now < 0.4


def test_the_wait_after_a_stop_is_bounded(monkeypatch):
    clock = Clock()
    fake = install(monkeypatch, FakeNvml(h200s(1), clock=clock))
    fake.start_process(0, 8 * GIB, pid=777)  # never leaves
    backend = LocalBackend(clock=clock, sleep=clock.sleep)
    backend.end_group(_group(1))
    with pytest.raises(InsufficientGPUsError, match=r"compute process\(es\) \[777\]"):
        backend.place(_group(1))
    assert GPU_RELEASE_WAIT_S <= clock.now < GPU_RELEASE_WAIT_S + 0.1


def test_ending_an_earlier_attempts_orphans_makes_placement_wait_for_their_gpus(monkeypatch):
    key = f"run-{uuid.uuid4().hex[:8]}"
    group = GroupSpec(name="train", entrypoint="trainer.train", num_workers=1, use_gpu=True, run_key=key)
    orphan = subprocess.Popen(["sleep", "600"], env={**os.environ, RUN_KEY_ENV: key, GROUP_ENV: "train"})
    try:
        time.sleep(0.1)
        fake = install(monkeypatch, FakeNvml(h200s(1), list_lag_s=0.3))
        fake.attach(orphan.pid, 0, 8 * GIB)
        backend = LocalBackend()
        ended = backend.end_earlier_attempts(group)
        assert [p["pid"] for p in ended[0].found] == [orphan.pid]
        assert [p.devices for p in backend.place(group)] == [(fake.gpus[0].uuid,)]
    finally:
        if orphan.poll() is None:
            os.kill(orphan.pid, signal.SIGKILL)
        orphan.wait()
