"""The SSH backend through real OpenSSH servers on 127.0.0.2 and 127.0.0.3 (tests/support/sshd.py), the provider's
SSHHook with host-key checking on, and the real agent: placement, streaming, failures, stopping, release, and
that no secret reaches any command line. Each case prints what it measured.

What these hosts cannot show: separate kernels. They share this machine's process table and Python, so the tests
check each host's own disk (its TMPDIR) and address, not separate machines.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest
from tf_multiworker.backends import DEFAULT_REMOTE_WORKDIR, ssh_backend

from core.config import RunConfig
from core.layout import StorageLayout
from core.protocol import ABORT_SIGNAL, GROUP_ENV, RUN_KEY_ENV
from core.storage import read_json
from launcher import FailureKind, GroupSpec, GroupState, LaunchError, WorkerGroup, error_for
from launcher.ssh_agents import RemoteHost
from tasks.launch import RecordedLaunch
from tasks.release import processes_of_run
from tests.launcher.conftest import REPO, entrypoint_env, run_past_sigkill, start_launcher, wait_for

SECRET = "ssh-secret-value-never-in-argv"


@pytest.fixture
def connections(ssh_hosts, monkeypatch):
    """The fake hosts as Airflow connections (by environment, as a deployment would register them)."""
    for host in ssh_hosts:
        for name, value in host.connection_env().items():
            monkeypatch.setenv(name, value)
    return [host.conn_id for host in ssh_hosts]


def _backend(conn_ids, **settings):
    # The hosts share no filesystem with this one: an ssh run's storage root is object storage (RunConfig's rule).
    return ssh_backend(RunConfig.of(backend="ssh", storage_root="s3://tfmw-test/ssh", ssh_conn_ids=list(conn_ids),
                                    workers_per_host=0, **settings))


def _spec(run_key: str, fault: str = "", **changes) -> GroupSpec:
    env = entrypoint_env(TINY_WORKER_FAULT=fault) if fault else entrypoint_env()
    settings = {"name": "tiny", "entrypoint": "tiny_worker", "num_workers": 2, "env": env, "run_key": run_key,
                "startup_timeout_s": 30, "hang_timeout_s": 30, "grace_period_s": 2,
                "secret_env": {"AWS_SECRET_ACCESS_KEY": SECRET}}
    return GroupSpec(**{**settings, **changes})


def _run(spec, backend, tmp_path):
    lines: list[tuple[int, str]] = []
    group = WorkerGroup(spec, backend, tmp_path, on_line=lambda r, line: lines.append((r, line)))
    started = time.monotonic()
    try:
        result = group.run()
    finally:
        backend.close()
    return result, time.monotonic() - started, lines


def _start_endless_group(key: str, connections, tmp_path):
    """A 2-rank group that trains until stopped, running in a thread; returns once both ranks and their children
    (4 processes carrying the run key) are up."""
    spec = _spec(key, env=entrypoint_env(TINY_WORKER_STEPS="100000", TINY_WORKER_STEP_S="0.1"))
    backend = _backend(connections)
    group = WorkerGroup(spec, backend, tmp_path)
    runner = threading.Thread(target=group.run)
    runner.start()
    deadline = time.monotonic() + 30
    while len(processes_of_run(key)) < 4 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert len(processes_of_run(key)) >= 4, "the group did not start"
    return group, backend, runner


def _cmdlines_with(text: str) -> list[str]:
    found = []
    for entry in Path("/proc").iterdir():
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if text in cmdline:
            found.append(f"{entry.name}: {cmdline}")
    return found


def _wait_gone(key: str, timeout_s: float) -> dict[int, str]:
    deadline = time.monotonic() + timeout_s
    while (left := processes_of_run(key)) and time.monotonic() < deadline:
        time.sleep(0.1)
    return left


def test_two_hosts_run_one_rank_each_on_their_own_address_and_disk(ssh_hosts, connections, tmp_path):
    key = "ssh-happy"
    spec = _spec(key, env=entrypoint_env(TINY_WORKER_TEMP="1", TINY_WORKER_STEP_S="0.2"))
    seen_in_argv: list[str] = []
    watcher_stop = threading.Event()

    def watch_cmdlines():
        while not watcher_stop.is_set():
            seen_in_argv.extend(_cmdlines_with(SECRET))
            time.sleep(0.05)

    watcher = threading.Thread(target=watch_cmdlines)
    watcher.start()
    try:
        result, wall_s, lines = _run(spec, _backend(connections), tmp_path)
    finally:
        watcher_stop.set()
        watcher.join()
    print(f"\n2 ranks on 2 SSH hosts: {result.state.value} in {wall_s:.2f} s")
    assert result.succeeded, result.error_message()
    assert [w.host for w in result.workers] == [h.address for h in ssh_hosts]
    assert [w.record["conn_id"] for w in result.workers] == connections
    assert all(w.record["remote_pgid"] for w in result.workers)
    for rank, host in enumerate(ssh_hosts):  # each rank ran under its own host's disk, in its own temp dir there
        own = host.tmpdir / DEFAULT_REMOTE_WORKDIR / key / "tiny" / f"rank-{rank}" / "tmp"
        assert (rank, f"temp dir {own} held 0 entries; host temp {host.tmpdir}") in lines
        assert (rank, f"rank {rank} finished") in lines
        assert any(line.startswith("[agent] ") and "tensorflow" in line for r, line in lines if r == rank)
    assert seen_in_argv == [], "a secret value appeared in a command line"
    assert _wait_gone(key, 5) == {}


def test_a_worker_sigkilled_on_one_host_fails_the_group_naming_host_and_rank(ssh_hosts, connections, tmp_path):
    key = "ssh-sigkill"
    result, _, _ = _run(_spec(key, "1:sigkill"), _backend(connections), tmp_path)
    message = result.error_message()
    print(f"\nSIGKILL on {ssh_hosts[1].address}: detected in {result.failures[1].elapsed_s:.2f} s\n{message}")
    assert result.state is GroupState.FAILED and result.failures[1].kind is FailureKind.SIGNAL
    assert f"rank 1 (host {ssh_hosts[1].address}, pid " in message and "killed by SIGKILL" in message
    assert _wait_gone(key, 10) == {}, "a process of the run outlived the group on some host"


def test_a_rank_sigkilled_on_one_host_ends_a_survivor_that_outlives_sigterm_within_2_seconds(ssh_hosts, connections,
                                                                                              tmp_path):
    """The survivor outlives SIGTERM (as the trainer blocked in a collective with its dead peer does): the launcher
    asks the other host's agent to abort it, well inside the 30 s grace."""
    key = "ssh-sigkill-abort"
    spec = _spec(key, grace_period_s=30,
                 env=entrypoint_env(TINY_WORKER_FAULT="1:sigkill", TINY_WORKER_BLOCKED_ON_TERM="1"))
    backend = _backend(connections)
    try:
        result, ended_after_s = run_past_sigkill(spec, backend, tmp_path)
    finally:
        backend.close()
    print(f"\nrank 1 SIGKILLed on {ssh_hosts[1].address}: the group ended {ended_after_s:.2f} s later")
    assert result.failures[1].kind is FailureKind.SIGNAL and set(result.failures) == {1}
    assert result.workers[0].exit_code == -ABORT_SIGNAL and ended_after_s < 2
    assert _wait_gone(key, 0.5) == {}, "a process of the run outlived the group on some host"


def test_stopping_the_group_ends_every_remote_process_within_seconds(ssh_hosts, connections, tmp_path):
    key = "ssh-stop"
    group, backend, runner = _start_endless_group(key, connections, tmp_path)
    started = time.monotonic()
    group.stop("test", grace_s=1.0)
    left = _wait_gone(key, 10)
    stopped_s = time.monotonic() - started
    runner.join(15)
    backend.close()
    print(f"\nstop: every remote process gone after {stopped_s:.2f} s")
    assert left == {} and stopped_s < 10


def test_a_dropped_connection_ends_the_remote_workers(ssh_hosts, connections, tmp_path):
    """The agent's dead-man's switch: when the SSH connection dies, sshd closes its stdin and it ends its worker."""
    key = "ssh-drop"
    group, backend, runner = _start_endless_group(key, connections, tmp_path)
    started = time.monotonic()
    for client in list(backend._clients.values()):
        client.get_transport().sock.close()  # the network goes away under paramiko
    left = _wait_gone(key, 15)
    gone_s = time.monotonic() - started
    group.stop("test over", grace_s=0.5)
    runner.join(15)
    backend.close()
    print(f"\nconnection dropped: remote workers gone after {gone_s:.2f} s")
    assert left == {}


def _quiet_spec(key: str) -> dict:
    """Two ranks that join and then print nothing for ten minutes (a first step's compilation, a stall)."""
    return {"name": "tiny", "entrypoint": "tiny_worker", "num_workers": 2, "run_key": key, "grace_period_s": 10,
            "startup_timeout_s": 30, "hang_timeout_s": 900,
            "env": entrypoint_env(TINY_WORKER_STEPS="3", TINY_WORKER_STEP_S="600")}


def _parent(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def _cmdline(pid: int) -> bytes:
    return Path(f"/proc/{pid}/cmdline").read_bytes()


def test_a_sigkilled_launcher_ends_every_remote_worker_within_seconds_while_they_print_nothing(
        ssh_hosts, connections, tmp_path):
    """The kernel closes a dead launcher's SSH sockets: each agent's stdin ends without the stop line, so it ends
    its worker with the orphan grace (3 s), not the group's 10 s."""
    key = f"ssh-orphans-{time.time_ns()}"
    launcher, records = start_launcher(tmp_path, _quiet_spec(key), "ssh",
                                       {"ssh_conn_ids": connections, "workers_per_host": 0})
    wait_for(lambda: len(processes_of_run(key)) == 4, 30)
    assert [r["conn_id"] for r in records] == connections
    launcher.send_signal(signal.SIGKILL)
    launcher.wait()
    gone_s = wait_for(lambda: not processes_of_run(key), 10)
    print(f"\nlauncher SIGKILLed: the workers on {[h.address for h in ssh_hosts]} gone {gone_s:.2f} s later")


def test_the_next_attempt_ends_what_an_earlier_one_left_on_every_host(ssh_hosts, connections, tmp_path, caplog):
    """Launcher and agents killed outright (nothing left to stop the workers): the retry's reap finds them."""
    key = f"ssh-leftovers-{time.time_ns()}"
    launcher, _ = start_launcher(tmp_path, _quiet_spec(key), "ssh",
                                 {"ssh_conn_ids": connections, "workers_per_host": 0})
    wait_for(lambda: len(processes_of_run(key)) == 4, 30)
    agents = {parent for pid in processes_of_run(key) if b"launcher.agent" in _cmdline(parent := _parent(pid))}
    assert len(agents) == 2
    for pid in (*agents, launcher.pid):
        os.kill(pid, signal.SIGKILL)
    launcher.wait()
    time.sleep(1)
    left = processes_of_run(key)
    assert len(left) == 4, "with its agent gone a remote worker outlives its launcher"
    with caplog.at_level("WARNING"):
        result, _, _ = _run(_spec(key, grace_period_s=10), _backend(connections), tmp_path / "retry")
    assert result.succeeded, result.error_message()
    ended = [r.message for r in caplog.records if "earlier attempt" in r.message]
    print("\n" + "\n".join(ended))
    # The fake hosts share one process table: whichever host's agent looks first ends them all.
    assert ended and all(f"pid {pid} " in " ".join(ended) for pid in left)
    assert not set(left) & set(processes_of_run(key))


def test_release_ends_a_runs_processes_on_every_host(ssh_hosts, connections, tmp_path):
    """A rank left running (its launcher died without stopping it) is found on its host by the run marker."""
    key = "ssh-release"
    backend = _backend(connections)
    channel = backend._open(backend.hosts[1], "run")
    env = {"TFMW_RUN_KEY": key, "PYTHONPATH": entrypoint_env()["PYTHONPATH"]}
    channel.sendall(json.dumps({"argv": ["sleep", "600"], "env": env, "cwd": f"tfmw/{key}/x",
                                "grace_s": 1}).encode() + b"\n")
    deadline = time.monotonic() + 20
    while not processes_of_run(key) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert processes_of_run(key)
    result = backend.release(key, [])
    backend.close()
    print(f"\nrelease over SSH: {json.dumps(result.to_xcom()['hosts'])[:600]}")
    assert result.clean and [h.host for h in result.hosts] == [h.address for h in ssh_hosts]
    # The fake hosts share one process table, so whichever host's agent looks first ends it.
    assert [pid for h in result.hosts for pid in h.terminated] and processes_of_run(key) == {}
    assert not (ssh_hosts[1].tmpdir / "tfmw" / key).exists()  # its run directory on that host's disk is gone


def test_each_host_proves_the_groups_slots_free_right_after_it_exits(ssh_hosts, connections, tmp_path):
    """Issue 40, item 6 on SSH: the one launch path asks every host's agent (`slots`) right after the group exited;
    a process of the group still alive on a host holds the proof back until it is gone (bounded)."""
    key = f"ssh-slots-{time.time_ns()}"
    run = StorageLayout(str(tmp_path / "storage")).run(key)
    launch = RecordedLaunch(_spec(key), _backend(connections), run, on_line=lambda *_: None)
    leftover: list[subprocess.Popen] = []

    def check_with_a_leftover(group, workers):  # as if a rank's child escaped its process group
        leftover.append(subprocess.Popen(["sleep", "60"], env={**os.environ, RUN_KEY_ENV: key, GROUP_ENV: "tiny"}))
        # Long enough that every agent (about 0.3 s to start, seconds on a loaded machine) finds it still running.
        threading.Timer(2.5, leftover[0].kill).start()
        return type(launch.backend).check_slots_free(launch.backend, group, workers)

    launch.backend.check_slots_free = check_with_a_leftover
    try:
        result = launch.run_group()
    finally:
        launch.backend.close()
        for process in leftover:
            process.kill()
            process.wait()
    check = launch.after_exit.to_json()
    print(f"\nslots over SSH after exit: {json.dumps(check)[:700]}")
    assert result.succeeded, result.error_message()
    assert check["checked"] is True and check["free"] is True and check["slots"] == "cpu", check
    assert [h["host"] for h in check["hosts"]] == [h.address for h in ssh_hosts]
    # The fake hosts share one process table: each host's agent waited for the leftover.
    assert all(0.3 <= h["free_after_s"] < 6 for h in check["hosts"]), check
    assert 2.5 <= check["release_after_train_s"] < 15, check
    assert read_json(run.state_file("tiny"))["after_exit"]["release_after_train_s"] == check["release_after_train_s"]


def test_a_host_that_cannot_be_asked_leaves_the_slots_unproven(ssh_hosts, connections, tmp_path):
    backend = _backend(connections)
    result, _, _ = _run(_spec(f"ssh-slots-gone-{time.time_ns()}"), backend, tmp_path)
    assert result.succeeded, result.error_message()
    backend.hosts[1] = RemoteHost(backend.hosts[1].conn_id, "127.0.0.9", lambda: (_ for _ in ()).throw(OSError("no")))
    check = backend.check_slots_free(_spec("ssh-slots-gone"), result.workers)
    backend.close()
    assert check["free"] is False and check["free_after_s"] is None
    assert check["hosts"][0]["free"] is True and "unreachable" in check["hosts"][1]["error"]


def test_release_fails_loudly_when_a_host_cannot_be_reached(ssh_hosts, connections, monkeypatch):
    monkeypatch.setenv("AIRFLOW_CONN_TFMW_SSH_GONE", json.dumps(dict(ssh_hosts[1].connection(), host="127.0.0.9")))
    backend = _backend([connections[0], "tfmw_ssh_gone"])
    result = backend.release("ssh-release-gone", [])
    backend.close()
    gone = result.hosts[1]
    assert result.clean is False and result.hosts[0].evidence["clean"] is True
    assert gone.host == "127.0.0.9" and "unreachable" in gone.error


def test_an_unreachable_host_fails_placement_in_seconds_naming_it(ssh_hosts, connections, tmp_path, monkeypatch):
    dead = dict(ssh_hosts[1].connection(), host="127.0.0.9")
    monkeypatch.setenv("AIRFLOW_CONN_TFMW_SSH_DEAD", json.dumps(dead))
    started = time.monotonic()
    with pytest.raises(LaunchError, match=r"host 127\.0\.0\.9 \(connection tfmw_ssh_dead\) is unreachable"):
        _run(_spec("ssh-dead"), _backend([connections[0], "tfmw_ssh_dead"]), tmp_path)
    print(f"\nunreachable host refused after {time.monotonic() - started:.2f} s")
    assert time.monotonic() - started < 15
    assert not (tmp_path / "logs" / "rank-0.log").exists(), "no worker may start when a host is unreachable"


@pytest.mark.parametrize("host_key", ["wrong", "missing"])
def test_a_host_key_that_is_unknown_or_wrong_is_refused(ssh_hosts, connections, tmp_path, monkeypatch, host_key):
    other = ssh_hosts[0].host_key if host_key == "wrong" else None
    monkeypatch.setenv(f"AIRFLOW_CONN_{ssh_hosts[1].conn_id.upper()}",
                       json.dumps(ssh_hosts[1].connection(host_key=other)))
    started = time.monotonic()
    with pytest.raises(LaunchError, match=rf"host {ssh_hosts[1].address} .*host key.*host_key"):
        _run(_spec("ssh-hostkey"), _backend(connections), tmp_path)
    print(f"\n{host_key} host key refused after {time.monotonic() - started:.2f} s")


def test_a_remote_python_that_does_not_exist_is_refused_naming_host_and_setting(ssh_hosts, connections, tmp_path):
    with pytest.raises(LaunchError, match=rf"host {re.escape(ssh_hosts[0].address)} .*exited 127.*set remote_python"):
        _run(_spec("ssh-python"), _backend(connections, remote_python="/nowhere/bin/python3"), tmp_path)


def test_more_workers_than_the_hosts_take_is_refused_before_launch(connections, tmp_path):
    with pytest.raises(LaunchError, match=r"num_workers=3 but the hosts take only 2 worker\(s\).*workers_per_host"):
        _run(_spec("ssh-capacity", num_workers=3), _backend(connections), tmp_path)


def test_unknown_and_non_ssh_connections_are_refused_naming_the_setting(connections, monkeypatch):
    with pytest.raises(LaunchError, match=r"'ssh_conn_ids' names 'no_such_host', which is no Airflow connection"):
        _backend([connections[0], "no_such_host"])
    monkeypatch.setenv("AIRFLOW_CONN_NOT_SSH", json.dumps({"conn_type": "aws", "login": "x"}))
    with pytest.raises(LaunchError, match=r"'not_ssh', a connection of type 'aws'"):
        _backend(["not_ssh"])


# ---------------------------------------------------------------------------------------------------------------
# the agents' answers stubbed: which hosts are asked, together, and how ports are shared out


def _stubbed(monkeypatch, answers: dict, workers_per_host: int = 0, barrier: threading.Barrier | None = None,
             mode: str = "probe"):
    from launcher.ssh import SSHBackend
    from launcher.ssh_agents import RemoteHost

    hosts = [RemoteHost(conn_id=name, address=f"{name}.example", connect=lambda: None) for name in answers]
    backend = SSHBackend(hosts, remote_python="python3", remote_workdir="/tmp/tfmw", workers_per_host=workers_per_host)
    asked: list[tuple[str, int]] = []

    def request(host, asked_mode, payload, timeout_s=30.0):
        assert asked_mode == mode
        asked.append((host.conn_id, payload["ports"] if mode == "probe" else payload["run_key"]))
        if barrier is not None:
            barrier.wait()  # breaks unless every request of the wave is in flight at once
        answer = answers[host.conn_id]
        if isinstance(answer, Exception):
            raise answer
        return answer

    monkeypatch.setattr(backend, "request", request)
    return backend, asked


def _probe(ports, gpus=()):
    return {"versions": {"tensorflow": "2.21.0"}, "free_ports": list(ports), "free_gpus": list(gpus),
            "workdir_writable": True}


def test_hosts_are_probed_at_once_and_never_share_a_port(monkeypatch):
    # Three "hosts" on one kernel offer the same free ports: each takes one no earlier host took.
    answers = {name: _probe([41000, 41001, 41002]) for name in ("a", "b", "c")}
    backend, asked = _stubbed(monkeypatch, answers, barrier=threading.Barrier(3, timeout=10))
    placements = backend.place(GroupSpec(name="g", entrypoint="tiny_worker", num_workers=3))
    assert [(p.host, p.port) for p in placements] == [("a.example", 41000), ("b.example", 41001),
                                                       ("c.example", 41002)]
    assert sorted(asked) == [("a", 3), ("b", 3), ("c", 3)]


def test_a_host_beyond_those_needed_is_not_probed_and_a_needed_one_that_fails_is_named(monkeypatch):
    from launcher.ssh_agents import HostError

    down = HostError("host c.example (connection c) is unreachable: ConnectionRefusedError")
    answers = {"a": _probe([41000, 41001]), "b": _probe([41005, 41006]), "c": down}
    backend, asked = _stubbed(monkeypatch, answers)
    placements = backend.place(GroupSpec(name="g", entrypoint="tiny_worker", num_workers=2))
    assert [p.host for p in placements] == ["a.example", "b.example"] and [h for h, _ in asked] == ["a", "b"]

    # Host a has no free GPU, so a second wave asks c, which is down: placement fails naming it.
    answers = {"a": _probe([41000, 41001], gpus=()), "b": _probe([41005, 41006], gpus=(0,)), "c": down}
    backend, asked = _stubbed(monkeypatch, answers)
    with pytest.raises(HostError, match="c.example"):
        backend.place(GroupSpec(name="g", entrypoint="tiny_worker", num_workers=2, use_gpu=True))
    assert [h for h, _ in asked] == ["a", "b", "c"]


def test_release_asks_every_host_at_once_and_names_one_it_cannot_reach(monkeypatch):
    from launcher.ssh_agents import HostError

    released = {"host": "x", "found": [], "terminated": [4242], "killed": [], "survivors": [], "clean": True}
    down = HostError("host b.example (connection b) is unreachable: ConnectionRefusedError")
    backend, asked = _stubbed(monkeypatch, {"a": released, "b": down, "c": released}, mode="release",
                              barrier=threading.Barrier(3, timeout=10))
    result = backend.release("run-1", [])
    assert sorted(asked) == [("a", "run-1"), ("b", "run-1"), ("c", "run-1")]
    assert [(h.host, h.terminated) for h in result.hosts] == [("a.example", (4242,)), ("b.example", ()),
                                                              ("c.example", (4242,))]
    assert "unreachable" in result.hosts[1].error and result.clean is False


def test_each_placed_gpus_idle_level_travels_from_its_agents_probe_to_the_record_and_back_to_its_release(monkeypatch):
    """The agent reads a free GPU's idle level (launcher/gpu_memory.py); the placement keeps it for the state record,
    and release hands each host the levels its own GPUs were recorded at. A malformed level is dropped (that GPU is
    then judged as never seen idle)."""
    from launcher.state_record import RecordedWorker, StateRecord

    probe = {**_probe([41000], gpus=("GPU-a",)), "gpus": {"nvml": True, "idle_mb": {"GPU-a": 615, "GPU-b": "x"}}}
    backend, _ = _stubbed(monkeypatch, {"a": probe, "b": _probe([41001], gpus=("GPU-b",))})
    placements = backend.place(GroupSpec(name="g", entrypoint="tiny_worker", num_workers=2, use_gpu=True))
    assert [p.gpu_idle_mb for p in placements] == [{"GPU-a": 615}, {}]

    payloads = {}

    def request(host, mode, payload, timeout_s=30.0):
        payloads[host.conn_id] = dict(payload)
        return {"host": host.conn_id, "found": [], "terminated": [], "killed": [], "survivors": [], "clean": True}

    monkeypatch.setattr(backend, "request", request)
    workers = tuple(RecordedWorker(rank, f"{conn}.example", 41000, (gpu,), levels, extra={"conn_id": conn})
                    for rank, (conn, gpu, levels) in enumerate([("a", "GPU-a", {"GPU-a": 615}), ("b", "GPU-b", None)]))
    backend.release("run-1", [StateRecord("g", "ssh", "running", "2026-12-07T03:00:00.000Z", "", workers=workers)])
    assert {conn: payload["idle_mb"] for conn, payload in payloads.items()} == {"a": {"GPU-a": 615}, "b": {}}


def test_a_malformed_agent_answer_makes_its_host_an_error_not_a_release(monkeypatch):
    """A host's answer is untrusted input: survivors that are not a list, or a GPU check that is not an object,
    cannot vouch for anything, so the host counts as not released and says why."""
    good = {"host": "x", "found": [], "terminated": [], "killed": [], "survivors": [], "clean": True,
            "removed_dirs": ["/tmp/tfmw/run-1"]}
    odd = {**good, "survivors": "none", "gpu_check": ["free"]}
    backend, _ = _stubbed(monkeypatch, {"a": good, "b": odd}, mode="release")
    result = backend.release("run-1", [])
    assert result.hosts[0].error is None and result.hosts[0].entry()["removed_dirs"] == ["/tmp/tfmw/run-1"]
    assert result.hosts[0].entry()["hostname"] == "x" and result.hosts[0].host == "a.example"
    assert "its agent's answer is malformed: HostRelease.survivors: expected tuple" in result.hosts[1].error
    assert result.clean is False


def test_capacity_probes_every_host_at_once_and_keeps_only_the_usable_ones(monkeypatch):
    from launcher.backend import Capacity
    from launcher.ssh_agents import HostError

    down = HostError("host b.example (connection b) is unreachable: ConnectionRefusedError")
    answers = {"a": _probe([41000], gpus=(0, 1)), "b": down, "c": _probe([41000], gpus=()),
               "d": _probe([41000], gpus=(3,))}
    backend, asked = _stubbed(monkeypatch, answers, barrier=threading.Barrier(4, timeout=10))
    found = backend.capacity(GroupSpec(name="g", entrypoint="tiny_worker", num_workers=4, use_gpu=True))
    assert sorted(asked) == [("a", 0), ("b", 0), ("c", 0), ("d", 0)]
    assert found == Capacity(3, ("host b.example unreachable", "host c.example has no free GPU"),
                             {"ssh_conn_ids": ["a", "d"]}, ("a.example", "d.example"))
    assert [h.conn_id for h in backend.hosts] == ["a", "d"]  # placement now uses only these

    # Without GPUs a host takes workers_per_host (else one); every host answered: nothing to narrow.
    backend, _ = _stubbed(monkeypatch, {"a": _probe([41000]), "c": _probe([41000])}, workers_per_host=2)
    assert backend.capacity(GroupSpec(name="g", entrypoint="tiny_worker", num_workers=4)) == Capacity(
        4, (), {}, ("a.example", "c.example"))


# -- a host's link going down (namespaced hosts only: tests/support/netns.py) -------------------------------------

LINK_TRAIN = {"model": "tiny", "tokenizer": "bpe:320", "block_size": 32, "batch_size_per_worker": 4,
              "max_steps": 80, "warmup_steps": 2, "learning_rate": 3e-3, "checkpoint_every_steps": 4,
              "collective_timeout_s": 60, "num_workers": 2, "backend": "ssh", "baseline": "skip"}


def test_a_host_whose_link_goes_down_ends_the_group_naming_it_and_the_retry_resumes(ssh_hosts, connections,
                                                                                     tmp_path, s3_bucket):
    """A pulled cable, not a crash: host 2's link goes down mid-training (no process dies, no connection is
    closed). The group must end naming that host; with the link back, the next attempt resumes from the latest
    checkpoint in object storage (the hosts share no files)."""
    from core import storage
    from tests.trainer.shards import write_dataset
    from trainer.checkpoint import latest_step

    if ssh_hosts[1].network is None:
        pytest.skip("needs test hosts on network stacks of their own (root and iproute2): tests/support/netns.py")
    dataset = write_dataset(tmp_path / "dataset", sorted((REPO / "data" / "sample").glob("*.txt")), block_size=32,
                            vocab_size=320, num_train_shards=4, max_chars=20_000)
    root = f"{s3_bucket}/link"
    remote = f"{root}/datasets/{Path(dataset).parent.name}"
    storage.upload_tree(Path(dataset).parent, remote)
    manifest = f"{remote}/{Path(dataset).name}"
    config = f"{root}/config.json"
    storage.write_json_atomic(config, {**LINK_TRAIN, "ssh_conn_ids": connections, "storage_root": root})
    output = f"{root}/train"
    credentials = {name: os.environ[name] for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY",
                                                        "AWS_DEFAULT_REGION", "AWS_ENDPOINT_URL")}
    spec = _spec("ssh-link", name="train", entrypoint="trainer.train",
                 args=("--config", config, "--manifest", manifest, "--output", output),
                 env=entrypoint_env(TF_CPP_MIN_LOG_LEVEL="2"), secret_env=credentials,
                 startup_timeout_s=180, hang_timeout_s=180)
    lost = ssh_hosts[1]
    outcome: dict = {}
    runner = threading.Thread(target=lambda: outcome.update(first=_run(spec, _backend(connections), tmp_path / "1")))
    runner.start()
    try:
        wait_for(lambda: latest_step(f"{output}/checkpoints") >= 4 or not runner.is_alive(), 300, interval_s=1)
        assert runner.is_alive(), f"training ended before its first checkpoint: {outcome['first'][0]}"
        lost.network.set_link(False)
        cut = time.monotonic()
        runner.join(300)
        ended_s = time.monotonic() - cut
    finally:
        lost.network.set_link(True)
    result, _, lines = outcome["first"]
    message = str(error_for(result))
    print(f"\nlink of host {lost.address} down after checkpoint step {latest_step(f'{output}/checkpoints')}: "
          f"group ended after {ended_s:.1f} s: {message.splitlines()[0]}")
    assert not result.succeeded and f"host {lost.address}" in message, message
    assert _wait_gone("ssh-link", 30) == {}, "a worker outlived its group"

    resumed_from = latest_step(f"{output}/checkpoints")
    result, _, lines = _run(spec, _backend(connections), tmp_path / "2")
    assert result.succeeded, "\n".join(line for _, line in lines[-40:])
    summary = storage.read_json(f"{output}/summary.json")
    print(f"retry with the link up: resumed from step {summary['resumed_from_step']} and finished at step "
          f"{summary['steps']}")
    assert summary["resumed_from_step"] == resumed_from >= 4 and summary["steps"] == LINK_TRAIN["max_steps"]


class ScriptedProbes:
    """The agents' probe answers, one list per round (the last repeats), on a fake clock: no SSH, no GPU."""

    def __init__(self, free_gpus_per_round: list[list[list[str]]]) -> None:
        self.rounds, self.asked, self.now = free_gpus_per_round, 0, 0.0
        self.gpus = {"nvml": True, "left_out": []}

    def ask_all(self, hosts, mode, payload, timeout_s=None):
        assert mode == "probe"
        answer = self.rounds[min(self.asked, len(self.rounds) - 1)]
        self.asked += 1
        return [{"free_gpus": gpus, "free_ports": [7000 + i, 7100 + i], "workdir_writable": True,
                 "versions": {"python": "3"}, "gpus": self.gpus} for i, gpus in enumerate(answer)]

    def sleep(self, seconds: float) -> None:
        self.now += seconds


def _scripted_backend(probes: ScriptedProbes):
    from launcher.ssh import SSHBackend
    from launcher.ssh_agents import RemoteHost

    hosts = [RemoteHost(f"h{i}", f"10.0.0.{i + 1}", lambda: None) for i in range(2)]
    backend = SSHBackend(hosts, remote_python="python3", remote_workdir="tfmw", clock=lambda: probes.now,
                         sleep=probes.sleep)
    backend.ask_all = probes.ask_all
    return backend


GPU_GROUP = GroupSpec(name="train", entrypoint="trainer.train", num_workers=2, use_gpu=True, run_key="k")


def test_a_relaunch_waits_bounded_for_the_gpus_its_stopped_ranks_held():
    """Issue 38, item 4: right after a group's ranks were stopped, NVML still lists them for about 0.1 s; the next
    placement probes again, bounded, instead of failing on GPUs they still held."""
    from launcher.errors import InsufficientGPUsError
    from launcher.gpus import GPU_RELEASE_WAIT_S

    probes = ScriptedProbes([[[], []], [["GPU-a"], []], [["GPU-a"], ["GPU-b"]]])
    backend = _scripted_backend(probes)
    backend.end_group(GPU_GROUP)
    placements = backend.place(GPU_GROUP)
    assert [p.devices for p in placements] == [("GPU-a",), ("GPU-b",)] and probes.asked == 3

    never = ScriptedProbes([[[], []]])  # the GPUs never come back: refused once the wait is over
    backend = _scripted_backend(never)
    backend.end_group(GPU_GROUP)
    with pytest.raises(InsufficientGPUsError):
        backend.place(GPU_GROUP)
    assert GPU_RELEASE_WAIT_S <= never.now < GPU_RELEASE_WAIT_S + 1

    fresh = ScriptedProbes([[[], []]])  # nothing stopped: no waiting
    with pytest.raises(InsufficientGPUsError):
        _scripted_backend(fresh).place(GPU_GROUP)
    assert fresh.asked == 1 and fresh.now == 0


def test_placement_names_the_gpus_a_host_left_out_and_why():
    """Issue 38, item 3: a GPU the agent's NVML cannot read is left out of placement, and the refusal names it."""
    from launcher.errors import InsufficientGPUsError

    probes = ScriptedProbes([[["GPU-a"], []]])
    probes.gpus = {"nvml": True, "left_out": [{"gpu": 1, "uuid": None, "reason": "GPU is lost (NVML GPU_IS_LOST)"}]}
    backend = _scripted_backend(probes)
    with pytest.raises(InsufficientGPUsError, match=r"left out: GPU 1 \(no UUID\): GPU is lost"):
        backend.place(GPU_GROUP)
    assert "has no free GPU; left out: GPU 1 (no UUID): GPU is lost" in " ".join(backend.capacity(GPU_GROUP).reasons)


def test_gpu_utilization_is_asked_of_each_host_at_once_and_a_silent_host_gives_no_sample(monkeypatch):
    """The idle-held warning's samples on SSH (launcher/idle.py): each host's agent reads its ranks' GPUs; a host
    that does not answer gives None, which counts as busy."""
    from launcher import WorkerOutcome, WorkerState
    from launcher.ssh import SSHBackend
    from launcher.ssh_agents import HostError, RemoteHost

    hosts = [RemoteHost(conn_id=name, address=f"{name}.example", connect=lambda: None) for name in ("a", "b")]
    backend = SSHBackend(hosts, remote_python="python3", remote_workdir="/tmp/tfmw")
    asked = []

    def request(host, mode, payload, timeout_s=30.0):
        asked.append((host.conn_id, mode, payload))
        if host.conn_id == "b":
            raise HostError("host b.example is unreachable")
        return {"host": "a", "utilization": [3.0, 0.0]}

    monkeypatch.setattr(backend, "request", request)
    workers = [WorkerOutcome(rank, f"{conn}.example", 0, None, (f"GPU-{rank}",), WorkerState.READY, None,
                             {"conn_id": conn}) for rank, conn in enumerate(("a", "a", "b"))]
    gpu = GroupSpec(name="train", entrypoint="x", num_workers=3, use_gpu=True)
    assert backend.utilization(gpu, workers) == {0: 3.0, 1: 0.0, 2: None}
    assert sorted(asked) == [("a", "utilization", {"gpus": ["GPU-0", "GPU-1"]}),
                             ("b", "utilization", {"gpus": ["GPU-2"]})]
    assert backend.utilization(GroupSpec(name="train", entrypoint="x", num_workers=3), workers) is None


class _LinesChannel:
    """A session channel whose output is these lines."""

    def __init__(self, lines: list[bytes]) -> None:
        self.lines = lines

    def makefile(self, mode: str):
        import io
        return io.BytesIO(b"".join(self.lines))


@pytest.mark.parametrize("bad", [b"TFMW_AGENT {not json\n", b"TFMW_AGENT [1, 2]\n", b"TFMW_EXIT \xff\xfe\n",
                                 b'TFMW_AGENT {"pid": "1; kill", "pgid": 7}\n', b'TFMW_AGENT {"versions": [1]}\n',
                                 b'TFMW_EXIT {"error": {"x": 1}}\n'])
def test_a_malformed_control_line_is_ignored_and_counted_and_reading_goes_on(bad, caplog):
    """Review t5, not verified: a worker line that starts with TFMW_AGENT/TFMW_EXIT but carries no JSON object raised
    in the thread that reads the rank's output. Now it is dropped and counted, and the lines after it still come."""
    from launcher.ssh_worker import SSHWorkerHandle
    agent = b'TFMW_AGENT {"pid": 4242, "pgid": 4242, "host": "h", "python": "3.12", "versions": {"tf": "2.21"}}\n'
    host = RemoteHost("gpu_host_1", "h.example", connect=lambda: None)
    handle = SSHWorkerHandle(None, host, 0, _LinesChannel([agent, bad, b"step 1\n", bad, b"step 2\n"]), "run-1")
    lines = list(iter(lambda: handle.output.readline(1 << 16), b""))
    assert lines[1:] == [b"step 1\n", b"step 2\n"] and lines[0].startswith(b"[agent] h: pid 4242")
    assert (handle.pid, handle.pgid, handle.agent_error) == (4242, 4242, None)
    assert handle.malformed_control_lines == 2
    assert "ignored a malformed agent control line" in caplog.text


def test_a_second_agent_line_printed_by_the_worker_cannot_change_the_pid_release_signals():
    from launcher.ssh_worker import SSHWorkerHandle
    agent = b'TFMW_AGENT {"pid": 4242, "pgid": 4242}\n'
    forged = b'TFMW_AGENT {"pid": 1234, "pgid": 1234}\n'
    host = RemoteHost("gpu_host_1", "h.example", connect=lambda: None)
    handle = SSHWorkerHandle(None, host, 0, _LinesChannel([agent, forged, b"done\n"]), "run-1")
    assert list(iter(lambda: handle.output.readline(-1), b""))[1:] == [b"done\n"]
    assert (handle.pid, handle.pgid, handle.malformed_control_lines) == (4242, 4242, 1)
