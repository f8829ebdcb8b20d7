"""The local backend with real worker processes (tiny entry points, real sockets, the real process table).

Each fault case prints the result, the error text and the time to detect, and checks that no process of the
group (workers and the `sleep` child each one starts) is left.
"""

from __future__ import annotations

import os
import signal
import socket
import tempfile
import threading
import time
from pathlib import Path

import pytest

from core.protocol import ABORT_SIGNAL
from launcher import (
    FailureKind,
    GroupSpec,
    GroupState,
    InsufficientGPUsError,
    LocalBackend,
    PortAllocator,
    WorkerGroup,
    WorkerState,
)
from launcher.gpus import Gpu, GpuInventory
from launcher.log_policy import VERBOSE_ENV
from tasks.release import processes_of_run
from tests.launcher.conftest import (
    ACCESS_POLICY_ENV,
    alive,
    entrypoint_env,
    guards_of,
    run_past_sigkill,
    start_launcher,
    wait_for,
    wait_until_gone,
)


def _spec(fault: str = "", num_workers: int = 2, **changes) -> GroupSpec:
    env = entrypoint_env(TINY_WORKER_FAULT=fault) if fault else entrypoint_env()
    settings = {"name": "tiny", "entrypoint": "tiny_worker", "num_workers": num_workers, "env": env,
                    "startup_timeout_s": 4, "hang_timeout_s": 2, "grace_period_s": 2}
    return GroupSpec(**{**settings, **changes})


def _run(spec: GroupSpec, tmp_path, backend=None):
    lines: list[tuple[int, str]] = []
    group = WorkerGroup(spec, backend or LocalBackend(), tmp_path, on_line=lambda r, line: lines.append((r, line)))
    started = time.monotonic()
    result = group.run()
    return result, time.monotonic() - started, lines


def _assert_no_process_left(result):
    pgids = [w.record["pgid"] for w in result.workers]
    assert pgids and wait_until_gone(pgids, timeout_s=0) == [], "worker processes left behind"


def test_all_ranks_succeed_and_stream_prefixed_logs(tmp_path):
    result, wall_s, lines = _run(_spec(num_workers=3), tmp_path)
    print(f"\nall succeed: {result.state.value} in {wall_s:.2f} s")
    assert result.succeeded and result.attempts == 1
    assert [w.exit_code for w in result.workers] == [0, 0, 0]
    assert all(w.state is WorkerState.SUCCEEDED for w in result.workers)
    assert {(r, f"rank {r} finished") for r in range(3)} <= set(lines)
    assert "rank 2 step 4 done" in (tmp_path / "logs" / "rank-2.log").read_text()
    _assert_no_process_left(result)


@pytest.mark.parametrize("fault, kind, text", [
    ("exit1", FailureKind.EXIT_CODE, "rank 1 (host 127.0.0.1, pid {pid}) exited with code 1"),
    ("sigkill", FailureKind.SIGNAL, "rank 1 (host 127.0.0.1, pid {pid}) was killed by SIGKILL (signal 9)"),
    ("hang", FailureKind.HANG, "printed nothing for 2 s (hang_timeout_s=2)"),
    ("never_ready", FailureKind.STARTUP_TIMEOUT, "did not join the group within startup_timeout_s=4 s"),
])
def test_one_rank_fault_fails_the_group_and_stops_every_process(tmp_path, fault, kind, text):
    result, wall_s, _ = _run(_spec(f"1:{fault}"), tmp_path)
    message = result.error_message()
    root = result.failures[1]
    print(f"\n{fault}: {result.state.value}, detected {root.elapsed_s:.2f} s after launch, "
          f"group ended after {wall_s:.2f} s\n{message}")
    assert result.state is GroupState.FAILED and not result.succeeded
    assert root.kind is kind
    assert text.format(pid=root.pid) in message
    if kind in (FailureKind.EXIT_CODE, FailureKind.SIGNAL):
        assert set(result.failures) == {1}, "the surviving rank is stopped, not reported as a failure"
        assert result.workers[0].state is WorkerState.STOPPED
        assert "last lines of rank 1's log" in message
    if kind is FailureKind.STARTUP_TIMEOUT:
        assert set(result.failures) == {1} and "ranks that joined: [0]" in message
    _assert_no_process_left(result)


def test_a_rank_sigkilled_ends_a_survivor_that_outlives_sigterm_within_2_seconds(tmp_path):
    """Rank 0 waits for its dead peer and outlives SIGTERM (as the trainer blocked in a collective does): the
    launcher aborts it, so the group ends well inside its 30 s grace."""
    spec = _spec(grace_period_s=30, env=entrypoint_env(TINY_WORKER_FAULT="1:sigkill", TINY_WORKER_BLOCKED_ON_TERM="1"))
    result, ended_after_s = run_past_sigkill(spec, LocalBackend(), tmp_path)
    print(f"\nrank 1 SIGKILLed: the group ended {ended_after_s:.2f} s later")
    assert result.failures[1].kind is FailureKind.SIGNAL and set(result.failures) == {1}
    assert result.workers[0].state is WorkerState.STOPPED and result.workers[0].exit_code == -ABORT_SIGNAL
    assert ended_after_s < 2
    _assert_no_process_left(result)


class _FirstPortBusy(PortAllocator):
    """Hands out `busy` as rank 1's port on the first allocation (a real socket holds it), fresh ports after."""

    def __init__(self, busy: int) -> None:
        super().__init__()
        self.busy = busy
        self.calls = 0

    def allocate(self, count: int) -> list[int]:
        self.calls += 1
        ports = super().allocate(count)
        return [ports[0], self.busy, *ports[2:]] if self.calls == 1 else ports


def test_port_taken_before_bind_is_detected_and_relaunched_on_new_ports(tmp_path):
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", 0))
        squatter.listen()
        busy = squatter.getsockname()[1]
        result, wall_s, _ = _run(_spec(), tmp_path, LocalBackend(ports=_FirstPortBusy(busy)))
    print(f"\nport {busy} busy on attempt 1: {result.state.value} after {result.attempts} attempts, {wall_s:.2f} s")
    assert result.succeeded and result.attempts == 2
    assert busy not in [w.port for w in result.workers]
    assert "Address already in use" in (tmp_path / "logs" / "rank-1.log").read_text()


def test_port_bind_failure_is_bounded(tmp_path):
    class AlwaysBusy(PortAllocator):
        def allocate(self, count):
            return [busy] * count

    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", 0))
        squatter.listen()
        busy = squatter.getsockname()[1]
        result, _, _ = _run(_spec(max_launch_attempts=2), tmp_path, LocalBackend(ports=AlwaysBusy()))
    assert result.attempts == 2 and not result.succeeded
    assert {f.kind for f in result.failures.values()} == {FailureKind.PORT_BIND}
    assert f"port {busy} was already in use" in result.error_message()


def test_two_groups_at_once_get_distinct_ports(tmp_path):
    results = {}

    def launch(name):
        spec = _spec(name=name, env=entrypoint_env(TINY_WORKER_STEPS="10"))
        results[name] = WorkerGroup(spec, LocalBackend(), tmp_path / name, on_line=lambda r, line: None).run()

    threads = [threading.Thread(target=launch, args=(name,)) for name in ("a", "b")]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    ports = [w.port for result in results.values() for w in result.workers]
    print(f"\ntwo groups at once: ports {ports}")
    assert all(result.succeeded and result.attempts == 1 for result in results.values())
    assert len(set(ports)) == 4


def test_stop_from_another_thread_ends_every_worker_within_grace(tmp_path):
    group = WorkerGroup(_spec(env=entrypoint_env(TINY_WORKER_STEPS="100000")), LocalBackend(), tmp_path,
                        on_line=lambda r, line: None)
    stopper = threading.Timer(1.5, group.stop, args=("test asks to stop",))
    stopper.start()
    result = group.run()
    stopper.join()
    assert result.state is GroupState.STOPPED and not result.failures
    assert "stopped from outside" in result.error_message()
    assert [w.state for w in result.workers] == [WorkerState.STOPPED] * 2
    _assert_no_process_left(result)


def test_more_workers_than_free_gpus_is_refused_before_launch(tmp_path):
    backend = LocalBackend(gpu_probe=lambda: GpuInventory((Gpu(0, "GPU-a"), Gpu(3, "GPU-d")), host="gpu-host-1"))
    with pytest.raises(InsufficientGPUsError,
                       match=r"num_workers=3 needs one GPU per worker.*host gpu-host-1 has 2 free GPU\(s\) \[0, 3\]"):
        backend.place(_spec(num_workers=3, use_gpu=True))
    assert [p.devices for p in backend.place(_spec(num_workers=2, use_gpu=True))] == [("GPU-a",), ("GPU-d",)]
    assert [p.devices for p in backend.place(_spec(num_workers=2, use_gpu=False))] == [(), ()]
    assert not (tmp_path / "logs").exists()


def test_use_gpu_without_gpus_names_the_setting(tmp_path):
    backend = LocalBackend(gpu_probe=lambda: GpuInventory(host="gpu-host-1"))
    with pytest.raises(InsufficientGPUsError, match="NVML finds no free GPU on host gpu-host-1.*set use_gpu to false"):
        _run(_spec(use_gpu=True), tmp_path, backend)


AIRFLOW_SECRETS = {
    "AIRFLOW__CORE__FERNET_KEY": "fernet-key-value-1234",
    "AIRFLOW__API_AUTH__JWT_SECRET": "jwt-secret-value-5678",
    "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": "postgresql://airflow:db-password@db/airflow",
    "AIRFLOW_CONN_OTHER_TEAM": "aws://other:other-team-secret@",
    "SOME_SERVICE_TOKEN": "unrelated-token-value",
}


def test_what_a_stopped_worker_leaves_in_its_temp_dir_stays_in_its_work_dir_and_the_next_start_clears_it(tmp_path):
    """A worker ended by a signal runs no cleanup: its temporary files must be where the launcher removes them."""
    host_temp = Path(tempfile.gettempdir())
    before = set(host_temp.iterdir())
    for attempt in (1, 2):
        spec = _spec("1:exit1", env=entrypoint_env(TINY_WORKER_FAULT="1:exit1", TINY_WORKER_TEMP="1"))
        result, _, lines = _run(spec, tmp_path / "workdir")
        assert result.state is GroupState.FAILED  # rank 0 was stopped (SIGTERM) by the launcher
        for rank in range(2):
            own = tmp_path / "workdir" / f"rank-{rank}" / "tmp"
            assert (rank, f"temp dir {own} held 0 entries; host temp {host_temp}") in lines, (attempt, lines)
            assert [p.name.startswith("left-behind-") for p in own.iterdir()] == [True]
        _assert_no_process_left(result)
    assert not [p for p in set(host_temp.iterdir()) - before if p.name.startswith("left-behind-")]


def test_workers_get_an_allow_listed_environment_and_secrets_are_redacted(tmp_path, monkeypatch):
    """Nothing of the launching process's environment but the allow-list (not the access policy's variables), plus
    the run's own variables, the pipeline's switches and secrets; a secret a worker prints reaches neither the task
    log nor the rank log file."""
    for name, value in {**AIRFLOW_SECRETS, **ACCESS_POLICY_ENV, VERBOSE_ENV: "1"}.items():
        monkeypatch.setenv(name, value)
    secret = "storage-secret-value-9876"
    spec = _spec(num_workers=2, secret_env={"AWS_SECRET_ACCESS_KEY": secret},
                 env=entrypoint_env(TINY_WORKER_ECHO_ENV="AWS_SECRET_ACCESS_KEY", TINY_WORKER_STEP_S="1",
                                    TFMW_RUN_KEY="run-env-test"))
    lines: list[str] = []
    group = WorkerGroup(spec, LocalBackend(), tmp_path, on_line=lambda rank, line: lines.append(line))
    environs: list[dict[str, str]] = []

    def read_environs():
        deadline = time.monotonic() + 30
        while len(environs) < 2 and time.monotonic() < deadline:
            environs.clear()
            for worker in list(group._workers):
                raw = Path(f"/proc/{worker.handle.pid}/environ").read_bytes().decode(errors="replace")
                environs.append(dict(item.split("=", 1) for item in raw.split("\0") if "=" in item))
            time.sleep(0.1)

    reader = threading.Thread(target=read_environs)
    reader.start()
    result = group.run()
    reader.join()

    assert result.succeeded and len(environs) == 2
    for environ in environs:
        assert not set(AIRFLOW_SECRETS) & set(environ) and not set(ACCESS_POLICY_ENV) & set(environ)
        assert environ[VERBOSE_ENV] == "1"
        assert not [v for v in environ.values() for s in AIRFLOW_SECRETS.values() if s in v]
        assert environ["PATH"] and environ["TFMW_RUN_KEY"] == "run-env-test" and environ["TF_CONFIG"]
        assert environ["AWS_SECRET_ACCESS_KEY"] == secret
    assert "AWS_SECRET_ACCESS_KEY=***" in lines and not [line for line in lines if secret in line]
    for rank in (0, 1):
        text = (tmp_path / "logs" / f"rank-{rank}.log").read_text()
        assert "AWS_SECRET_ACCESS_KEY=***" in text and secret not in text


def _quiet_spec(key: str, name: str = "tiny") -> dict:
    """Two ranks that join and then print nothing for ten minutes (a first step's compilation, a stall)."""
    return {"name": name, "entrypoint": "tiny_worker", "num_workers": 2, "run_key": key, "grace_period_s": 10,
            "startup_timeout_s": 30, "hang_timeout_s": 900,
            "env": entrypoint_env(TINY_WORKER_STEPS="3", TINY_WORKER_STEP_S="600")}


def test_workers_of_a_sigkilled_launcher_are_gone_within_seconds_while_they_print_nothing(tmp_path):
    """The launcher (an Airflow task runner) killed outright runs no cleanup: its guard ends the workers."""
    key = f"orphans-{time.time_ns()}"
    launcher, _ = start_launcher(tmp_path, _quiet_spec(key))
    wait_for(lambda: len(processes_of_run(key)) == 4, 30)  # both ranks and the child each one starts
    [guard] = guards_of(launcher.pid)
    launcher.send_signal(signal.SIGKILL)
    launcher.wait()
    gone_s = wait_for(lambda: not processes_of_run(key), 10)
    print(f"\nlauncher SIGKILLed: its 4 worker processes gone {gone_s:.2f} s later")
    wait_for(lambda: not alive(guard), 5)  # it scans once more, then exits
    guard_log = (tmp_path / "launcher-work" / "guard.log").read_text()
    assert "launcher gone: ended" in guard_log and '"terminated": [' in guard_log


def test_the_next_attempt_ends_what_an_earlier_one_left_when_even_its_guard_died(tmp_path, caplog):
    key = f"leftovers-{time.time_ns()}"
    launcher, records = start_launcher(tmp_path, _quiet_spec(key))
    wait_for(lambda: len(processes_of_run(key)) == 4, 30)
    for pid in (*guards_of(launcher.pid), launcher.pid):
        os.kill(pid, signal.SIGKILL)
    launcher.wait()
    time.sleep(1)
    left = processes_of_run(key)
    assert {r["pid"] for r in records} <= set(left), "without its guard the workers outlive the launcher"

    spec = GroupSpec(**{**_quiet_spec(key), "env": entrypoint_env()})
    with caplog.at_level("WARNING"):
        result = WorkerGroup(spec, LocalBackend(), tmp_path / "retry", on_line=lambda r, line: None).run()
    assert result.succeeded
    assert not set(left) & set(processes_of_run(key)) and not processes_of_run(key)
    ended = next(r.message for r in caplog.records if "earlier attempt" in r.message)
    print(f"\n{ended}")
    assert "ended what an earlier attempt of tiny left alive on" in ended
    assert all(f"pid {pid} " in ended for pid in left)


def test_an_earlier_attempt_of_another_group_of_the_run_is_left_alone(tmp_path):
    key = f"other-group-{time.time_ns()}"
    launcher, _ = start_launcher(tmp_path, _quiet_spec(key, name="baseline"))
    try:
        wait_for(lambda: len(processes_of_run(key)) == 4, 30)
        spec = GroupSpec(**{**_quiet_spec(key), "env": entrypoint_env()})
        assert WorkerGroup(spec, LocalBackend(), tmp_path / "train", on_line=lambda r, line: None).run().succeeded
        assert len(processes_of_run(key)) == 4, "the baseline group of the same run must keep running"
    finally:
        launcher.terminate()
        launcher.wait()
    wait_for(lambda: not processes_of_run(key), 20)


def test_release_never_names_a_recorded_pid_without_the_runs_marker_as_a_gpu_holder(monkeypatch):
    """Review t5, finding 6: a state record (storage content) named a bystander's pid; release listed it as a GPU
    holder and advised `kill -9` on it. Only processes that carry the run's marker are the run's."""
    import subprocess
    import sys

    from launcher.local import LocalBackend
    from launcher.state_record import RecordedWorker, StateRecord
    from tests.support import fake_nvml

    fake = fake_nvml.install(monkeypatch, fake_nvml.FakeNvml(fake_nvml.h200s(1)))
    bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True)
    try:
        fake.attach(bystander.pid, 0, 8 << 30)
        record = StateRecord(task_id="train", backend="local", state="failed", updated_at="2026-12-07T00:00:00Z",
                             workdir="", workers=(RecordedWorker(0, "localhost", 1, extra={"pid": bystander.pid}),))
        result = LocalBackend().release("gpt_finetune-bystander-0123456789", [record], grace_s=0.5)
        host = result.hosts[0].entry()
        assert host["gpu_check"]["held_by_run"] == [] and host["found"] == [] and result.clean
        assert bystander.poll() is None  # not signalled either
    finally:
        bystander.kill()
        bystander.wait()
