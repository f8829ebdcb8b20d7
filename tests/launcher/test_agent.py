"""The remote agent as a local subprocess (what sshd would exec): the request on stdin, the control lines, the
stopping ladder on stdin EOF and on signals, and the probe / release / kill answers, against real processes."""

from __future__ import annotations

import json
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from importlib import metadata
from pathlib import Path

import pytest

from core.protocol import ABORT_LINE, ABORT_SIGNAL, STOP_LINE, read_control_line
from launcher.host_probe import VERSIONED_PACKAGES
from launcher.process import ORPHAN_GRACE_S, live_group_members
from tests.launcher.conftest import ENTRYPOINTS, alive

AGENT = [sys.executable, "-u", "-m", "launcher.agent"]
WORKER = [sys.executable, "-u", str(ENTRYPOINTS / "agent_worker.py")]
GRACE_S = 0.5



class Agent:
    """A `run` agent; its stdout is read on a thread so a test can wait for a line with a timeout."""

    def __init__(self, request: dict, env: dict[str, str] | None = None) -> None:
        self.process = subprocess.Popen([*AGENT, "run"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                        env=env or dict(os.environ))
        self.lines: list[str] = []
        self._queue: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        self.process.stdin.write(json.dumps(request).encode() + b"\n")
        self.process.stdin.flush()

    def _read(self) -> None:
        for raw in self.process.stdout:
            self._queue.put(raw.decode().rstrip("\n"))
        self._queue.put(None)

    def next_line(self, timeout_s: float = 20) -> str | None:
        line = self._queue.get(timeout=timeout_s)
        if line is not None:
            self.lines.append(line)
        return line

    def wait_for(self, prefix: str) -> str:
        while (line := self.next_line()) is not None:
            if line.startswith(prefix):
                return line[len(prefix):].strip()
        raise AssertionError(f"no line starting {prefix!r}; got {self.lines}")

    def finish(self, timeout_s: float = 20) -> int:
        while self.next_line(timeout_s) is not None:
            pass
        return self.process.wait(timeout_s)

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()


@pytest.fixture
def agents():
    started: list[Agent] = []
    yield lambda *args, **kwargs: started.append(Agent(*args, **kwargs)) or started[-1]
    for agent in started:
        agent.close()


def _request(tmp_path: Path, mode: str = "stubborn", show: str = "", **env: str) -> dict:
    return {"argv": WORKER, "env": {"AGENT_WORKER_MODE": mode, "AGENT_WORKER_SHOW": show, **env},
            "cwd": str(tmp_path / "hostdisk" / "rank-0"), "grace_s": GRACE_S, "base_env": "inherit"}


def _control(line: str, tag: str) -> dict:
    """The payload of a control line, read as the SSH backend reads it."""
    control = read_control_line(line.encode())
    assert control is not None and control[0] == tag, f"expected a {tag} line, got {line!r}"
    return control[1]


def _started(agent: Agent) -> tuple[dict, int, int]:
    """The TFMW_AGENT line (which must come first) and the worker's and its child's pids."""
    announced = _control(agent.next_line(), "TFMW_AGENT")
    worker, child = map(int, agent.wait_for("pids ").split())
    return announced, worker, child


def test_environment_arrives_on_stdin_and_no_secret_is_in_any_command_line(agents, tmp_path):
    secret = f"secret-{uuid.uuid4().hex}"
    agent_env = {**os.environ, "TFMW_PROBE_INHERITED": "from-agent", "AIRFLOW__CORE__FERNET_KEY": "not-for-workers"}
    agent = agents(_request(tmp_path, show="TFMW_PROBE_INHERITED,AIRFLOW__CORE__FERNET_KEY,GIVEN",
                            GIVEN="given", TFMW_SECRET=secret), env=agent_env)
    _, worker, _ = _started(agent)
    shown = json.loads(agent.lines[1].removeprefix("env "))
    assert shown == {"TFMW_PROBE_INHERITED": "from-agent", "AIRFLOW__CORE__FERNET_KEY": None, "GIVEN": "given"}
    assert f"TFMW_SECRET={secret}".encode() in Path(f"/proc/{worker}/environ").read_bytes().split(b"\0")

    in_argv = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if secret.encode() in cmdline.read_bytes():
                in_argv.append(cmdline.parent.name)
        except OSError:
            continue
    assert in_argv == [], f"the secret is in the command line of pids {in_argv}"

    cwd = tmp_path / "hostdisk" / "rank-0"
    assert os.readlink(f"/proc/{worker}/cwd") == str(cwd)
    assert cwd.stat().st_mode & 0o777 == 0o700
    agent.process.stdin.close()
    agent.finish()
    assert not any(secret in line for line in agent.lines)


@pytest.mark.parametrize(("mode", "code", "status"), [("exit:3", 3, 3), ("sigkill", -9, 128 + 9)])
def test_control_lines_relay_the_exit_code_and_leftovers_are_stopped(agents, tmp_path, mode, code, status):
    agent = agents(_request(tmp_path, mode))
    announced, worker, child = _started(agent)
    assert announced["pid"] == announced["pgid"] == worker
    assert announced["host"] == socket.gethostname()
    assert announced["python"] == "{}.{}.{}".format(*sys.version_info[:3])
    assert announced["versions"] == {name: metadata.version(name) for name in VERSIONED_PACKAGES}
    assert agent.finish() == status
    assert _control(agent.lines[-1], "TFMW_EXIT") == {"code": code}
    # The child ignores SIGTERM and outlived the worker: the agent's ladder ended it with SIGKILL.
    assert not alive(child) and live_group_members(worker) == []


def _assert_stopped_by_ladder(agent: Agent, worker: int, child: int, since: float) -> None:
    assert agent.finish() == 128 + signal.SIGKILL
    elapsed = time.monotonic() - since
    print(f"\nstubborn worker and child gone {elapsed:.2f} s after the trigger (grace {GRACE_S} s)")
    assert "TERM ignored" in agent.lines, "the worker must get SIGTERM before SIGKILL"
    assert _control(agent.lines[-1], "TFMW_EXIT") == {"code": -signal.SIGKILL}
    assert not alive(worker) and not alive(child) and live_group_members(worker) == []
    assert elapsed < GRACE_S + 5


def test_stdin_eof_stops_the_whole_group_term_then_kill(agents, tmp_path):
    agent = agents(_request(tmp_path))
    _, worker, child = _started(agent)
    since = time.monotonic()
    agent.process.stdin.close()  # what sshd does when the channel closes or the connection drops
    _assert_stopped_by_ladder(agent, worker, child, since)


@pytest.mark.parametrize("asked", [True, False])
def test_the_whole_grace_applies_only_to_a_stop_the_launcher_asked_for(agents, tmp_path, asked):
    """EOF without the stop line: the launcher died or the connection dropped, nobody waits for the worker, and its
    GPUs are wanted by the retry: ORPHAN_GRACE_S (3 s), not the request's grace."""
    agent = agents({**_request(tmp_path), "grace_s": 30})
    _, worker, child = _started(agent)
    if asked:
        agent.process.stdin.write(STOP_LINE)
        agent.process.stdin.flush()
        time.sleep(0.5)
    since = time.monotonic()
    agent.process.stdin.close()
    if asked:
        time.sleep(ORPHAN_GRACE_S + 2)
        assert alive(worker), "an asked-for stop gives the worker its whole grace period"
        agent.process.send_signal(signal.SIGKILL)
        os.killpg(worker, signal.SIGKILL)
        return
    assert agent.finish() == 128 + signal.SIGKILL
    elapsed = time.monotonic() - since
    print(f"\nstdin closed without the stop line: stubborn worker killed after {elapsed:.2f} s")
    assert ORPHAN_GRACE_S <= elapsed < ORPHAN_GRACE_S + 3 and not alive(worker) and not alive(child)


def test_the_abort_line_ends_a_worker_that_ignores_sigterm_at_once(agents, tmp_path):
    """Another rank failed: the launcher writes the abort line, and the group gets ABORT_SIGNAL, not SIGTERM."""
    agent = agents({**_request(tmp_path), "grace_s": 30})
    _, worker, child = _started(agent)
    since = time.monotonic()
    agent.process.stdin.write(ABORT_LINE)
    agent.process.stdin.close()
    assert agent.finish() == 128 + ABORT_SIGNAL
    elapsed = time.monotonic() - since
    print(f"\nabort line: the worker and its child gone {elapsed:.2f} s later (grace 30 s)")
    assert _control(agent.lines[-1], "TFMW_EXIT") == {"code": -ABORT_SIGNAL} and "TERM ignored" not in agent.lines
    assert not alive(worker) and not alive(child) and elapsed < 2


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP, signal.SIGINT])
def test_a_signal_to_the_agent_stops_the_whole_group(agents, tmp_path, signum):
    agent = agents(_request(tmp_path))
    _, worker, child = _started(agent)
    since = time.monotonic()
    agent.process.send_signal(signum)
    _assert_stopped_by_ladder(agent, worker, child, since)


def test_a_worker_that_cannot_start_is_reported_without_an_agent_line(agents, tmp_path):
    missing = agents({**_request(tmp_path), "argv": [str(tmp_path / "no-such-python"), "-m", "x"]})
    assert missing.finish() == 127
    assert missing.lines == [missing.lines[-1]]
    exit_line = _control(missing.lines[-1], "TFMW_EXIT")
    assert exit_line["code"] == 127 and "no-such-python" in exit_line["error"]

    bad = agents({"argv": WORKER, "env": {}, "grace_s": 1})
    assert bad.finish() == 2
    assert "missing fields ['cwd']" in _control(bad.lines[-1], "TFMW_EXIT")["error"]


def _one_shot(mode: str, request: bytes) -> subprocess.CompletedProcess:
    return subprocess.run([*AGENT, mode], input=request, capture_output=True, timeout=30, check=False)


def test_a_malformed_request_is_refused_without_echoing_it():
    secret = f"secret-{uuid.uuid4().hex}"
    done = _one_shot("run", f'{{"env": {{"K": "{secret}"}}, "argv": '.encode())
    assert done.returncode == 2
    assert _control(done.stdout.decode().strip(), "TFMW_EXIT")["code"] == 2
    assert secret not in (done.stdout + done.stderr).decode()


def _answer(mode: str, request: dict) -> dict:
    done = _one_shot(mode, json.dumps(request).encode() + b"\n")
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.decode().splitlines()
    assert len(lines) == 1, lines
    return json.loads(lines[0])


def test_probe_reports_identity_free_ports_and_the_workdir(tmp_path):
    workdir = tmp_path / "disk" / "tfmw"
    first = _answer("probe", {"ports": 4, "workdir": str(workdir), "use_gpu": False})
    assert first["host"] == socket.gethostname()
    assert first["python"] == "{}.{}.{}".format(*sys.version_info[:3])
    assert first["versions"] == {name: metadata.version(name) for name in VERSIONED_PACKAGES}
    assert first["free_gpus"] == [] and first["gpus"] is None
    assert first["workdir"] == str(workdir) and first["workdir_writable"] and workdir.is_dir()
    assert first["free_disk_bytes"] > 0
    ports = first["free_ports"]
    assert len(set(ports)) == 4
    for port in ports:  # free on every interface, as TensorFlow binds them
        with socket.socket() as sock:
            sock.bind(("0.0.0.0", port))

    second = _answer("probe", {"ports": 4, "workdir": str(workdir), "use_gpu": True})
    assert len(set(second["free_ports"])) == 4
    gpus = second["gpus"]
    assert len(second["free_gpus"]) == len(gpus["free"]) and set(gpus["free"]) <= set(range(gpus["count"]))
    assert gpus["nvml"] or gpus["count"] == 0

    blocker = tmp_path / "a-file"
    blocker.write_text("")
    blocked = _answer("probe", {"ports": 0, "workdir": str(blocker / "tfmw"), "use_gpu": False})
    assert not blocked["workdir_writable"] and "Error" in blocked["workdir_error"]


def _sleeper(key: str | None, **popen) -> subprocess.Popen:
    """A process that ignores SIGTERM, carrying `key` as its run key."""
    env = {name: value for name, value in os.environ.items() if name != "TFMW_RUN_KEY"}
    if key:
        env["TFMW_RUN_KEY"] = key
    return subprocess.Popen(["sh", "-c", 'trap "" TERM; exec sleep 600'], env=env, **popen)


@pytest.fixture
def sleepers():
    started: list[subprocess.Popen] = []
    yield lambda *args, **kwargs: started.append(_sleeper(*args, **kwargs)) or started[-1]
    for process in started:
        process.kill()
        process.wait()


def test_release_ends_only_the_runs_processes_and_removes_its_directory(sleepers, tmp_path):
    key, other = f"run-{uuid.uuid4().hex[:8]}", f"other-{uuid.uuid4().hex[:8]}"
    ours, theirs = sleepers(key), sleepers(other)
    run_dir = tmp_path / "workdir" / key
    (run_dir / "rank-0").mkdir(parents=True)
    time.sleep(0.1)  # sh has exec'd sleep with the trap in place

    released = _answer("release", {"run_key": key, "grace_s": GRACE_S, "workdir": str(tmp_path / "workdir"),
                                   "idle_mb": {}})
    assert [p["pid"] for p in released["found"]] == [ours.pid]
    assert "sleep 600" in released["found"][0]["cmdline"]
    assert released["terminated"] == [ours.pid] and released["killed"] == [ours.pid]
    assert released["survivors"] == [] and released["clean"] is True
    assert released["removed_dirs"] == [str(run_dir)] and not run_dir.exists()
    assert "nvml" in released["gpu_check"]
    assert not alive(ours.pid) and alive(theirs.pid)


def test_release_never_follows_a_symlinked_run_directory(tmp_path):
    key = f"run-{uuid.uuid4().hex[:8]}"
    target = tmp_path / "elsewhere"
    target.mkdir()
    (target / "keep.txt").write_text("not the run's")
    (tmp_path / "workdir").mkdir()
    (tmp_path / "workdir" / key).symlink_to(target)
    released = _answer("release", {"run_key": key, "grace_s": GRACE_S, "workdir": str(tmp_path / "workdir"),
                                   "idle_mb": {}})
    assert released["found"] == [] and released["removed_dirs"] == [] and released["clean"]
    assert (target / "keep.txt").exists()


def test_a_probe_with_a_field_the_contract_does_not_name_is_refused(tmp_path):
    done = _one_shot("probe", json.dumps({"ports": 1, "exclude": [], "workdir": str(tmp_path), "use_gpu": False})
                     .encode() + b"\n")
    assert done.returncode == 2
    assert "unknown fields ['exclude']" in json.loads(done.stdout)["error"]


def test_release_refuses_a_run_key_that_is_a_path():
    done = _one_shot("release", b'{"run_key": "../etc", "grace_s": 1, "workdir": "/tmp", "idle_mb": {}}\n')
    assert done.returncode == 2 and "'run_key' must be a run key" in json.loads(done.stdout)["error"]


def test_kill_refuses_an_unrelated_group_and_kills_the_runs(sleepers):
    key = f"run-{uuid.uuid4().hex[:8]}"
    unrelated, ours = sleepers(None, start_new_session=True), sleepers(key, start_new_session=True)
    time.sleep(0.1)

    refused = _answer("kill", {"pgid": unrelated.pid, "run_key": key})
    assert refused["status"] == "refused" and str(key) in refused["reason"]
    assert alive(unrelated.pid)
    assert _answer("kill", {"pgid": 1, "run_key": key})["status"] == "refused"

    killed = _answer("kill", {"pgid": ours.pid, "run_key": key})
    assert killed["status"] == "killed" and killed["members"] == [ours.pid] and killed["survivors"] == []
    assert not alive(ours.pid)
    assert _answer("kill", {"pgid": ours.pid, "run_key": key})["status"] == "gone"


def test_reap_ends_only_the_named_group_of_the_run():
    key = f"reap-{uuid.uuid4().hex[:8]}"
    sleepers = {group: subprocess.Popen(["sleep", "600"], env={"TFMW_RUN_KEY": key, "TFMW_GROUP": group})
                for group in ("train", "baseline")}
    try:
        answer = _answer("reap", {"run_key": key, "group": "train", "grace_s": 1})
        assert [p["pid"] for p in answer["found"]] == answer["terminated"] == [sleepers["train"].pid]
        assert answer["survivors"] == [] and answer["host"] == socket.gethostname()
        assert sleepers["train"].wait(5) == -signal.SIGTERM and sleepers["baseline"].poll() is None
    finally:
        for sleeper in sleepers.values():
            sleeper.kill()
            sleeper.wait()


def test_slots_are_free_once_no_process_of_the_group_is_left_and_a_bad_request_is_refused():
    key = f"slots-{uuid.uuid4().hex[:8]}"
    other = subprocess.Popen(["sleep", "600"], env={"TFMW_RUN_KEY": key, "TFMW_GROUP": "baseline"})
    try:  # another group of the run (baseline beside train) does not hold train's slots
        answer = _answer("slots", {"run_key": key, "group": "train", "pids": [], "gpus": [], "idle_mb": {},
                                         "use_gpu": False})
        assert answer["free"] is True and answer["processes_left"] == [] and 0 <= answer["free_after_s"] < 1, answer
    finally:
        other.kill()
        other.wait()
    done = _one_shot("slots", b'{"run_key": "k", "group": "train", "pids": ["1"], "gpus": [], "idle_mb": {}, '
                              b'"use_gpu": false}\n')
    assert done.returncode == 2 and "'pids' must be a list of pids" in json.loads(done.stdout)["error"]


def test_utilization_reads_each_named_gpu_and_none_without_nvml(monkeypatch):
    from launcher import agent
    from tests.support.fake_nvml import FakeNvml, h200s, install
    from tests.support.hardware import nvidia_gpus

    over_ssh = _answer("utilization", {"gpus": ["0"]})["utilization"]
    assert len(over_ssh) == 1 and (over_ssh[0] is None) == (not nvidia_gpus())  # no NVML here: no sample, never 0
    fake = install(monkeypatch, FakeNvml(h200s(2)))
    fake.gpus[1].utilization_pct = 42
    fake.gpus[0].mig = True  # NVML refuses utilization on a MIG-enabled GPU: no sample, never 0
    answer = agent.utilization({"gpus": [fake.gpus[1].uuid, "0", "1"]})
    assert answer["utilization"] == [42.0, None, 42.0]
