"""launcher.process with real processes: the stop ladder on whole process groups (a shell and the
`sleep` it starts), and finding and ending processes by the markers in their environment."""

from __future__ import annotations

import os
import signal
import subprocess
import time
import uuid
from pathlib import Path

import pytest

from launcher.process import (
    code_to_exit_status,
    end_marked_processes,
    exit_status_to_code,
    live_group_members,
    processes_with_env,
    signal_pids,
    stop_ladder,
)
from tests.launcher.conftest import alive

# A shell with a `sleep` child in its process group; it prints the child's pid once its signal handling is set.
OBEYS_TERM = "sleep 60 & echo $!; wait"
IGNORES_TERM = "trap '' TERM; sleep 60 & echo $!; wait"  # the ignored TERM is inherited by the sleep


def start_group(script: str, env: dict[str, str] | None = None) -> tuple[subprocess.Popen, int]:
    """A shell in its own session (its pid is the group id) running `script`; returns it and its child's pid."""
    shell = subprocess.Popen(["sh", "-c", script], stdout=subprocess.PIPE, text=True, start_new_session=True,
                             env={**os.environ, **(env or {})})
    child = int(shell.stdout.readline())
    return shell, child


@pytest.fixture
def groups():
    """Starts groups for a test and SIGKILLs whatever of them is left afterwards."""
    started: list[subprocess.Popen] = []

    def start(script: str, env: dict[str, str] | None = None) -> tuple[subprocess.Popen, int]:
        shell, child = start_group(script, env)
        started.append(shell)
        return shell, child

    yield start
    for shell in started:
        try:
            os.killpg(shell.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        shell.wait()
        shell.stdout.close()


def group_ladder(pgids: list[int], grace_s: float, killed: list[int], *, kill_works: bool = True) -> list[int]:
    def kill(pgid: int) -> None:
        if kill_works:
            os.killpg(pgid, signal.SIGKILL)

    return stop_ladder(pgids, terminate=lambda pgid: os.killpg(pgid, signal.SIGTERM), kill=kill,
                       gone=lambda pgid: not live_group_members(pgid), grace_s=grace_s, on_kill=killed.append,
                       kill_wait_s=2.0)


def test_live_group_members_keep_an_orphaned_child_and_leave_out_the_zombie(groups):
    shell, child = groups(OBEYS_TERM)
    assert sorted(live_group_members(shell.pid)) == sorted([shell.pid, child])
    os.kill(shell.pid, signal.SIGKILL)  # unreaped: a zombie that still counts for killpg(pgid, 0)
    deadline = time.monotonic() + 5
    while alive(shell.pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert Path(f"/proc/{shell.pid}").exists() and not alive(shell.pid)
    assert live_group_members(shell.pid) == [child]
    assert live_group_members(child) == []  # the child leads no group


def test_the_ladder_ends_a_group_that_obeys_sigterm_without_killing_it(groups):
    shell, child = groups(OBEYS_TERM)
    killed: list[int] = []
    started = time.monotonic()
    assert group_ladder([shell.pid], grace_s=10, killed=killed) == []
    assert time.monotonic() - started < 5, "the ladder waited for the grace period of a group that had stopped"
    assert killed == []
    assert not alive(child)


def test_the_ladder_kills_a_group_that_ignores_sigterm_after_the_grace_period(groups):
    polite, _ = groups(OBEYS_TERM)
    stubborn, stubborn_child = groups(IGNORES_TERM)
    killed: list[int] = []
    started = time.monotonic()
    assert group_ladder([polite.pid, stubborn.pid], grace_s=0.5, killed=killed) == []
    assert time.monotonic() - started >= 0.5
    assert killed == [stubborn.pid]
    assert live_group_members(stubborn.pid) == [] and not alive(stubborn_child)


def test_the_ladder_returns_the_targets_that_outlive_the_kill(groups):
    stubborn, _ = groups(IGNORES_TERM)
    killed: list[int] = []
    assert group_ladder([stubborn.pid], grace_s=0.2, killed=killed, kill_works=False) == [stubborn.pid]
    assert killed == [stubborn.pid]


def test_the_ladder_leaves_targets_that_are_already_gone_alone():
    def refuse(target: int) -> None:
        raise AssertionError(f"signalled {target}, which was gone")

    assert stop_ladder([1, 2], terminate=refuse, kill=refuse, gone=lambda target: True, grace_s=5) == []


def test_processes_are_found_by_every_marker_of_their_environment(groups):
    run = uuid.uuid4().hex
    train, train_child = groups(OBEYS_TERM, {"TEST_RUN": run, "TEST_TASK": "train"})
    evaluate, evaluate_child = groups(OBEYS_TERM, {"TEST_RUN": run, "TEST_TASK": "evaluate"})
    assert set(processes_with_env({"TEST_RUN": run})) == {train.pid, train_child, evaluate.pid, evaluate_child}
    one_task = processes_with_env({"TEST_RUN": run, "TEST_TASK": "train"})
    assert set(one_task) == {train.pid, train_child}
    assert one_task[train.pid] == f"sh -c {OBEYS_TERM}"
    assert processes_with_env({"TEST_RUN": uuid.uuid4().hex}) == {}
    with pytest.raises(ValueError, match="at least one marker"):
        processes_with_env({})


def test_end_marked_processes_terminates_then_kills_and_reports_each_step(groups):
    run = uuid.uuid4().hex
    polite, polite_child = groups(OBEYS_TERM, {"TEST_RUN": run})
    stubborn, stubborn_child = groups(IGNORES_TERM, {"TEST_RUN": run})
    outcome = end_marked_processes({"TEST_RUN": run}, grace_s=0.5)
    everyone = sorted([polite.pid, polite_child, stubborn.pid, stubborn_child])
    assert [found["pid"] for found in outcome["found"]] == everyone
    assert outcome["terminated"] == everyone
    assert outcome["killed"] == sorted([stubborn.pid, stubborn_child])
    assert outcome["survivors"] == []
    assert end_marked_processes({"TEST_RUN": run}, grace_s=0.5) == {"found": [], "terminated": [], "killed": [],
                                                                     "survivors": []}


def test_signal_pids_names_only_the_processes_that_existed(groups):
    _, child = groups(OBEYS_TERM)
    reaped = subprocess.Popen(["true"])
    reaped.wait()
    assert signal_pids([child, reaped.pid], signal.SIGKILL) == [child]


# -- a host without /proc (issue 37 item 5, review finding 12) --------------------------------------------------

def test_without_proc_finding_processes_fails_with_a_clear_error_and_no_launch_starts(tmp_path, monkeypatch):
    """The review's reproduction: with /proc missing, the guard's `end_workers` raised FileNotFoundError, and every
    local launch with a run key failed the same way in `end_earlier_attempts`."""
    from launcher import guard, process
    from launcher.errors import LaunchError
    from launcher.local import LocalBackend
    from launcher.spec import GroupSpec

    monkeypatch.setattr(process, "PROC", tmp_path / "no-proc")
    message = r"has no readable process table at .*no-proc \(FileNotFoundError\).*use backend 'ssh' or 'kubernetes'"
    with pytest.raises(process.NoProcessTableError, match=message):
        guard.end_workers("train-0123", 0.1)
    spec = GroupSpec(name="train", entrypoint="tiny_worker", num_workers=1, run_key="run-0123456789")
    with pytest.raises(LaunchError, match=message):
        LocalBackend().end_earlier_attempts(spec)
    started = []
    monkeypatch.setattr(process.os, "getpid", os.getpid)
    from launcher import local

    monkeypatch.setattr(local.subprocess, "Popen", lambda *args, **kwargs: started.append(args))
    with pytest.raises(LaunchError, match=message):  # no run key: no sweep, but the guard could not work
        local._Guard.start(spec, tmp_path / "guard.log")
    assert started == []  # neither the guard nor a worker


def test_a_signal_s_exit_status_is_the_return_code_popen_gives_and_back():
    direct = subprocess.Popen(["sleep", "60"])
    direct.send_signal(signal.SIGTERM)
    code = direct.wait()
    # What a shell (and sshd, and a container runtime) reports for the same death: 128 + n.
    status = subprocess.run(["sh", "-c", "sleep 60 & kill -TERM $!; wait $!"], check=False).returncode
    assert (code, status) == (-signal.SIGTERM, 128 + signal.SIGTERM)
    assert exit_status_to_code(status) == code and code_to_exit_status(code) == status
    for ordinary in (0, 1, 2, 65, 75, 127, 128, 255):  # 255: ssh's own failure, not signal 127
        assert exit_status_to_code(ordinary) == ordinary == code_to_exit_status(ordinary)
