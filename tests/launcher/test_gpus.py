"""launcher/gpus.py and the local backend's use of it, on the fake NVML (tests/support/fake_nvml.py), whose idle GPU
reads what the measured H200 did (615 MiB used through v1, no process): an idle GPU is admitted and its idle level
recorded, release waits for the run's pids to leave (the measured 0.09-0.12 s lag) and for memory to come back to
that level, memory in use by another PID namespace keeps a GPU out,
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

from core.protocol import GROUP_ENV, RUN_KEY_ENV
from launcher import GroupSpec, InsufficientGPUsError, LocalBackend, tensorflow_env
from launcher.gpu_memory import IDLE_USED_MB_ENV, idle_levels_mb
from launcher.gpus import (
    GPU_RELEASE_WAIT_S,
    ReleaseWatch,
    probe_gpus,
    release_check,
    release_is_clean,
)
from launcher.state_record import RecordedWorker, StateRecord
from tests.launcher.conftest import alive
from tests.support import fake_nvml
from tests.support.fake_nvml import GIB, MIB, FakeNvml, h200s, install

# What the drivers without the v2 memory struct answer it with; None: the driver has it.
V2_ANSWERS = [None, fake_nvml.NVML_ERROR_FUNCTION_NOT_FOUND, fake_nvml.NVML_ERROR_ARGUMENT_VERSION_MISMATCH,
              fake_nvml.NVML_ERROR_NOT_SUPPORTED]


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


@pytest.mark.parametrize("v2_answer", [None, fake_nvml.NVML_ERROR_FUNCTION_NOT_FOUND])
def test_release_of_a_worker_that_ignores_sigterm_waits_for_nvml_and_reports_clean(monkeypatch, tmp_path, v2_answer):
    """LocalBackend.release end to end: TERM, grace, KILL of a real process, then NVML's lag, then clean once the
    GPU's memory is back at the idle level its placement recorded (615 MiB, by v2 or, where refused, v1)."""
    key = f"run-{uuid.uuid4().hex[:8]}"
    stubborn = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('ready', flush=True); " \
               "time.sleep(600)"
    worker = subprocess.Popen([sys.executable, "-c", stubborn],
                              env={**os.environ, RUN_KEY_ENV: key}, stdout=subprocess.PIPE, text=True)
    assert worker.stdout.readline().strip() == "ready"
    fake = install(monkeypatch, FakeNvml(h200s(1, memory_v2_error=v2_answer), list_lag_s=0.1))
    fake.attach(worker.pid, 0, 8 * GIB)
    try:
        recorded = RecordedWorker(0, "localhost", None, (fake.gpus[0].uuid,), {fake.gpus[0].uuid: 615},
                                  extra={"pid": worker.pid})
        record = StateRecord("train", "local", "running", "2026-12-05T07:00:00.000Z", "", workers=(recorded,))
        released = LocalBackend().release(key, [record], grace_s=0.3)
    finally:
        worker.kill()
        worker.wait()
    host = released.hosts[0].entry()
    assert host["killed"] == [worker.pid] and released.clean is True, released
    assert host["gpu_check"]["held_by_run"] == [] and host["gpu_check"]["free_after_s"] >= 0.05
    (device,) = host["gpu_check"]["devices"]
    assert device["used_mb"] + device.get("reserved_mb", 0) == 615 and device["pids"] == []
    assert device["memory_call"] == ("v2" if v2_answer is None else "v1")
    assert not alive(worker.pid)


# -- admission and release across PID namespaces: item 2(b) -------------------------------------------------------

def test_a_gpu_whose_memory_another_namespace_uses_is_not_free(monkeypatch):
    """Drivers >= 570 drop another namespace's process from the list; its memory stays in use (review section 3)."""
    fake = install(monkeypatch, FakeNvml(h200s(2)))
    fake.start_process(1, 40 * GIB, listed_pid=None)
    gpus = probe_gpus()
    assert gpus.free_indices == [0]
    (busy, reason), = gpus.left_out
    assert busy.index == 1 and "41063 MiB of them outside the driver's reservation" in reason  # 103 idle + 40960
    assert "another PID namespace" in reason
    with pytest.raises(InsufficientGPUsError, match=rf"host {socket.gethostname()} has 1 free GPU.*GPU 1 "
                                                    rf"\({fake.gpus[1].uuid}\).*another PID namespace"):
        LocalBackend().place(_group(2))


def test_the_idle_level_is_a_setting(monkeypatch):
    fake = install(monkeypatch, FakeNvml(h200s(1)))
    fake.start_process(0, 600 << 20, listed_pid=None)
    assert probe_gpus().free_indices == []
    assert probe_gpus({IDLE_USED_MB_ENV: "1280"}).free_indices == [0]  # 615 idle + 600, reservation included


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
        assert "8807 MiB are in use by no listed process, 8295 MiB of them outside the driver's reservation" in \
            check["unverified"][0]["reason"]
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


# -- the idle level comes from the device: issue 47 ----------------------------------------------------------------

@pytest.mark.parametrize("v2_answer", V2_ANSWERS)
def test_an_idle_gpu_as_the_h200_reported_it_is_admitted_and_its_idle_level_recorded(monkeypatch, v2_answer):
    """615 MiB used and no process is idle, whichever memory call the driver answers; the placement records it."""
    fake = install(monkeypatch, FakeNvml(h200s(2, memory_v2_error=v2_answer)))
    placements = LocalBackend().place(_group(2))
    assert [p.gpu_idle_mb for p in placements] == [{gpu.uuid: 615} for gpu in fake.gpus]
    device = probe_gpus().free[0].record()
    if v2_answer is None:
        assert (device["memory_call"], device["used_mb"], device["reserved_mb"]) == ("v2", 103, 512)
    else:
        assert (device["memory_call"], device["used_mb"]) == ("v1", 615)
        assert device["memory_note"].startswith("the driver refused the v2 struct (NVMLError_")


@pytest.mark.parametrize(("idle_mb", "reserved_mb"), [(615, 0), (615, 300), (2048, 1990)])
def test_an_idle_gpu_is_admitted_whatever_its_v2_struct_splits_out(monkeypatch, idle_mb, reserved_mb):
    """v2 was not measured: no reservation split out, part of it left in `used`, or a reservation larger than v1's
    allowance: an idle GPU is free in each (the first judged on v1's figure, the last on v2's `used`)."""
    install(monkeypatch, FakeNvml(h200s(1, idle_used_bytes=idle_mb * MIB, reserved_bytes=reserved_mb * MIB)))
    gpus = probe_gpus()
    assert gpus.free_indices == [0] and gpus.free[0].idle_mb == idle_mb


@pytest.mark.parametrize("v2_answer", [None, fake_nvml.NVML_ERROR_FUNCTION_NOT_FOUND])
@pytest.mark.parametrize("held_mb", [4096, 780])  # 4 GiB, and a bare CUDA context (about 780 MiB on the H200)
def test_memory_held_from_another_namespace_keeps_the_gpu_out(monkeypatch, v2_answer, held_mb):
    fake = install(monkeypatch, FakeNvml(h200s(2, memory_v2_error=v2_answer)))
    fake.start_process(1, held_mb * MIB, listed_pid=None)
    gpus = probe_gpus()
    assert gpus.free_indices == [0]
    (busy, reason), = gpus.left_out
    assert busy.index == 1 and reason.startswith(f"{615 + held_mb} MiB are in use by no listed process")
    if v2_answer is None:
        assert f"{103 + held_mb} MiB of them outside the driver's reservation (NVML v2); idle is up to 898 MiB, or " \
               "280 MiB outside the reservation (scaled to its 143771 MiB" in reason
    else:
        assert "(NVML v1); idle is up to 898 MiB (scaled to its 143771 MiB" in reason
    assert IDLE_USED_MB_ENV in reason and "another PID namespace" in reason


@pytest.mark.parametrize("code", [fake_nvml.NVML_ERROR_NO_PERMISSION, fake_nvml.NVML_ERROR_GPU_IS_LOST])
def test_a_gpu_whose_idle_level_cannot_be_read_is_left_out_naming_host_and_gpu(monkeypatch, code):
    """Only a driver's "no v2 struct" answers fall back to v1: any other error leaves the GPU out, never in."""
    gpus = h200s(2)
    gpus[1].memory_v2_error = code
    fake = install(monkeypatch, FakeNvml(gpus))
    with pytest.raises(InsufficientGPUsError) as refused:
        LocalBackend().place(_group(2))
    message = str(refused.value)
    assert f"host {socket.gethostname()} has 1 free GPU(s) [0]" in message
    assert f"GPU 1 ({fake.gpus[1].uuid}): NVML cannot read it (NVMLError_" in message and "use_gpu" in message


def _held_then_ended(fake: FakeNvml, still_held_mb: int = 0) -> None:
    """The run's worker (pid 4242) held 8 GiB of GPU 0 and was just ended; `still_held_mb` stays in use by no listed
    process (a context torn down late, or a child in another namespace)."""
    fake.start_process(0, 8 * GIB, pid=4242)
    if still_held_mb:
        fake.start_process(0, still_held_mb * MIB, listed_pid=None)
    fake.end_process(4242)


@pytest.mark.parametrize("v2_answer", [None, fake_nvml.NVML_ERROR_FUNCTION_NOT_FOUND])
def test_memory_that_never_comes_back_to_the_recorded_level_is_unverified_naming_the_level_and_figure(monkeypatch,
                                                                                                    v2_answer):
    clock = Clock()
    fake = install(monkeypatch, FakeNvml(h200s(1, memory_v2_error=v2_answer), clock=clock))
    _held_then_ended(fake, still_held_mb=600)  # below a first admission's 898 MiB, above the level's margin
    uuid_ = fake.gpus[0].uuid
    check = _check(ReleaseWatch(frozenset({4242}), frozenset({0}), frozenset({uuid_}), {uuid_: 615}), clock)
    assert check["held_by_run"] == [] and check["free_after_s"] is None and release_is_clean(check) is False
    (entry,) = check["unverified"]
    assert (entry["gpu"], entry["uuid"]) == (0, uuid_)
    assert "1215 MiB are in use by no listed process" in entry["reason"]  # 615 idle + 600, both calls alike
    assert "its idle level, recorded at placement, is 615 MiB (+ 256 MiB margin)" in entry["reason"]
    assert GPU_RELEASE_WAIT_S <= clock.now < GPU_RELEASE_WAIT_S + 0.1


def test_a_level_recorded_by_v2_holds_when_release_reads_v1(monkeypatch):
    clock = Clock()
    fake = install(monkeypatch, FakeNvml(h200s(1), clock=clock))
    (placement,) = LocalBackend().place(_group(1))
    fake.gpus[0].memory_v2_error = fake_nvml.NVML_ERROR_NOT_SUPPORTED  # release reads v1 (615 MiB used)
    _held_then_ended(fake)
    uuid_ = fake.gpus[0].uuid
    check = _check(ReleaseWatch(frozenset({4242}), frozenset({0}), frozenset({uuid_}), placement.gpu_idle_mb), clock)
    assert release_is_clean(check) and 0.1 <= check["free_after_s"] < 0.2


def test_without_a_recorded_idle_level_release_judges_the_gpu_as_never_seen_idle_and_says_so(monkeypatch):
    """A record that gives no level (an older record, or a malformed entry dropped on reading): the allowance of a
    first admission applies, and the message names it and the setting."""
    clock = Clock()
    fake = install(monkeypatch, FakeNvml(h200s(1), clock=clock))
    _held_then_ended(fake, still_held_mb=600)
    levels = {fake.gpus[0].uuid: -1, "1": True, "2": "615"}
    assert idle_levels_mb(levels) == {} and idle_levels_mb(None) == {}
    check = _check(ReleaseWatch(frozenset({4242}), frozenset({0}), None, idle_levels_mb(levels)), clock)
    reason = check["unverified"][0]["reason"]
    assert "1215 MiB are in use by no listed process, 703 MiB of them outside the driver's reservation" in reason
    assert "idle is up to 898 MiB, or 280 MiB outside" in reason and "no idle level was recorded for it" in reason
    assert IDLE_USED_MB_ENV in reason and release_is_clean(check) is False


def test_a_gpu_gone_between_placement_and_release_is_unverified_never_released(monkeypatch):
    fake = install(monkeypatch, FakeNvml(h200s(2)))
    placed = [p.devices[0] for p in LocalBackend().place(_group(2))]
    fake.gpus.pop()  # GPU 1 fell off the bus: NVML counts one GPU now
    record = StateRecord("train", "local", "running", "2026-12-07T03:00:00.000Z", "",
                         workers=tuple(RecordedWorker(rank, "localhost", None, (uuid_,), {uuid_: 615}, extra={})
                                       for rank, uuid_ in enumerate(placed)))
    released = LocalBackend().release(f"run-{uuid.uuid4().hex[:8]}", [record], grace_s=0.1)
    (entry,) = released.hosts[0].entry()["gpu_check"]["unverified"]
    assert entry == {"gpu": None, "uuid": placed[1], "reason": (
        f"the run was placed on GPU {placed[1]}, but NVML on host {socket.gethostname()} lists no such GPU among its "
        "1: whether the run's processes left it is unknown")}
    assert released.clean is False


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
