"""The group runner's supervising paths against a scripted backend (tests/launcher/fake_backend.py): start-up
timeout, hang watchdog, port-bind relaunch, a failing rank, secrets and stopping, each in well under a second."""

from __future__ import annotations

import json
import os
import threading
import time

import pytest

from core.protocol import EXIT_PREEMPTED
from launcher import FailureKind, GroupSpec, GroupState, LaunchError, WorkerGroup, WorkerState
from tests.launcher.fake_backend import FakeBackend

FAST = {"startup_timeout_s": 0.3, "hang_timeout_s": 0.3, "grace_period_s": 0.1}
OK = [("ready",), ("line", "step 1"), ("exit", 0)]


def _run(backend: FakeBackend, tmp_path, num_workers: int = 2, **changes):
    spec = GroupSpec(**{"name": "g", "entrypoint": "trainer.train", "num_workers": num_workers, **FAST, **changes})
    lines: list[tuple[int, str]] = []
    started = time.monotonic()
    result = WorkerGroup(spec, backend, tmp_path, on_line=lambda r, line: lines.append((r, line))).run()
    return result, time.monotonic() - started, lines


def test_ready_marker_then_exit_zero_succeeds_with_every_line_streamed(tmp_path):
    backend = FakeBackend({0: OK, 1: OK})
    result, wall_s, lines = _run(backend, tmp_path)
    assert result.succeeded and wall_s < 1
    assert {(0, "step 1"), (1, "step 1"), (1, "TFMW_READY rank=1")} <= set(lines)
    assert [w.record for w in result.workers] == [{"fake_pid": 1000}, {"fake_pid": 1001}]
    assert "step 1" in (tmp_path / "logs" / "rank-1.log").read_text()
    assert backend.ended_groups == 1


NATIVE_NOISE = "WARNING: All log messages before absl::InitializeLog() is called are written to STDERR"


def test_native_library_noise_stays_in_the_rank_log_but_not_in_the_task_log(tmp_path, monkeypatch):
    monkeypatch.delenv("GPT_FINETUNE_VERBOSE_LOGS", raising=False)
    backend = FakeBackend({0: [("line", NATIVE_NOISE), *OK]})
    result, _, lines = _run(backend, tmp_path, num_workers=1)
    assert result.succeeded and (0, "step 1") in lines and (0, NATIVE_NOISE) not in lines
    assert NATIVE_NOISE in (tmp_path / "logs" / "rank-0.log").read_text()
    assert "GPT_FINETUNE_VERBOSE_LOGS" not in backend.envs[0]


def test_verbose_logs_show_everything_and_reach_every_worker(tmp_path, monkeypatch):
    """Workers start from an allow-listed environment (a remote host's own on SSH): the launcher passes it on."""
    monkeypatch.setenv("GPT_FINETUNE_VERBOSE_LOGS", "1")
    backend = FakeBackend({0: [("line", NATIVE_NOISE), *OK], 1: OK})
    result, _, lines = _run(backend, tmp_path)
    assert result.succeeded and (0, NATIVE_NOISE) in lines
    assert all(env["GPT_FINETUNE_VERBOSE_LOGS"] == "1" for env in backend.envs)


def test_tf_config_and_run_marker_reach_every_rank(tmp_path):
    backend = FakeBackend({0: OK, 1: OK})
    _run(backend, tmp_path, run_key="run-7")
    configs = [json.loads(env["TF_CONFIG"]) for env in backend.envs]
    assert [c["task"]["index"] for c in configs] == [0, 1]
    assert configs[0]["cluster"]["worker"] == ["fake-host-0:20000", "fake-host-1:20001"]
    assert all(env["TFMW_RUN_KEY"] == "run-7" and env["TFMW_GROUP"] == "g" for env in backend.envs)


def test_what_an_earlier_attempt_left_is_ended_and_logged_before_the_launch(tmp_path, caplog):
    leftover = {"host": "h1", "found": [{"pid": 41, "cmdline": "python -m trainer.train"}], "terminated": [41],
                "killed": [], "survivors": []}
    backend = FakeBackend({0: OK}, earlier=[leftover, {"host": "h2", "found": [], "survivors": []}])
    with caplog.at_level("WARNING"):
        result, _, _ = _run(backend, tmp_path, num_workers=1, run_key="run-7")
    assert result.succeeded and backend.earlier_asked == ["g"]
    assert "ended what an earlier attempt of g left alive on h1: pid 41 python -m trainer.train" in caplog.text
    assert "h2" not in caplog.text


def test_no_launch_beside_an_earlier_attempt_that_survived_sigkill(tmp_path):
    backend = FakeBackend({0: OK}, earlier=[{"host": "h1", "found": [{"pid": 41, "cmdline": "x"}], "terminated": [41],
                                             "killed": [41], "survivors": [41]}])
    with pytest.raises(LaunchError, match=r"still alive after SIGKILL: 41 on h1\. Not launching beside them"):
        _run(backend, tmp_path, num_workers=1, run_key="run-7")
    assert backend.handles == []


def test_a_group_without_run_key_asks_for_no_earlier_attempts(tmp_path):
    backend = FakeBackend({0: OK})
    assert _run(backend, tmp_path, num_workers=1)[0].succeeded and backend.earlier_asked == []


def test_the_group_stops_when_its_supervisor_is_gone(tmp_path, monkeypatch):
    """Reparented (the supervisor was SIGKILLed): the group stops within a poll, with the orphan grace."""
    backend = FakeBackend({0: [("ready",), ("hang",)], 1: [("ready",), ("hang",)]}, ignore_term=[1])
    spec = GroupSpec(name="g", entrypoint="trainer.train", num_workers=2, **{**FAST, "hang_timeout_s": 30,
                                                                             "grace_period_s": 30})
    group = WorkerGroup(spec, backend, tmp_path, supervisor_pid=os.getppid())
    threading.Timer(0.2, monkeypatch.setattr, args=(os, "getppid", lambda: 1)).start()
    started = time.monotonic()
    result = group.run()
    assert result.state is GroupState.STOPPED and all(h.gone() for h in backend.handles)
    # Rank 1 ignores SIGTERM: killed after the orphan grace (3 s), not the group's grace of 30 s.
    assert backend.handles[1].signals == ["TERM", "KILL"] and time.monotonic() - started < 5


def test_a_rank_that_never_prints_its_marker_fails_at_the_startup_timeout(tmp_path):
    backend = FakeBackend({0: [("ready",), ("hang",)], 1: [("line", "importing"), ("hang",)]})
    result, wall_s, _ = _run(backend, tmp_path)
    failure = result.failures[1]
    assert set(result.failures) == {1} and failure.kind is FailureKind.STARTUP_TIMEOUT
    assert 0.3 <= failure.elapsed_s < 1 and wall_s < 2
    assert "ranks that joined: [0]" in failure.detail and "Raise startup_timeout_s" in failure.detail
    assert all(h.gone() for h in backend.handles)


def test_a_silent_group_after_joining_is_a_hang(tmp_path):
    backend = FakeBackend({0: [("ready",), ("hang",)], 1: [("ready",), ("hang",)]})
    result, wall_s, _ = _run(backend, tmp_path)
    assert {f.kind for f in result.failures.values()} == {FailureKind.HANG} and wall_s < 2
    assert "hang_timeout_s=0.3" in result.error_message()


def test_output_keeps_the_hang_watchdog_away(tmp_path):
    chatty = [("ready",)] + [step for i in range(8) for step in (("sleep", 0.1), ("line", f"step {i}"))] + [("exit", 0)]
    result, _, _ = _run(FakeBackend({0: chatty, 1: chatty}), tmp_path)
    assert result.succeeded  # 0.8 s of work, never 0.3 s of silence


def test_port_bind_failure_relaunches_on_new_ports_and_then_succeeds(tmp_path):
    def scripts(attempt, rank):
        if attempt == 1 and rank == 1:
            return [("line", "E0000 could not start gRPC server: Address already in use"), ("exit", 1)]
        return OK

    backend = FakeBackend(scripts)
    result, _, _ = _run(backend, tmp_path)
    assert result.succeeded and result.attempts == 2
    assert backend.ended_groups == 2


def test_port_bind_relaunches_are_bounded(tmp_path):
    taken = [("line", "failed to add port: EADDRINUSE"), ("exit", 1)]
    result, _, _ = _run(FakeBackend({0: OK, 1: taken}), tmp_path, max_launch_attempts=3)
    assert result.attempts == 3 and result.failures[1].kind is FailureKind.PORT_BIND
    assert "port 20" in result.failures[1].detail


FAILING_RANK_1 = {0: [("ready",), ("hang",)], 1: [("ready",), ("line", "boom"), ("exit", 3)]}


def test_a_failing_rank_aborts_the_others_at_once_without_the_grace(tmp_path, caplog):
    """A survivor blocked in a collective with the dead rank never acts on SIGTERM (`ignore_term`): a preemption
    checkpoint cannot be agreed without the dead rank, so the launcher does not ask for one."""
    backend = FakeBackend(FAILING_RANK_1, ignore_term=[0])
    result, wall_s, _ = _run(backend, tmp_path, grace_period_s=30)
    assert set(result.failures) == {1} and result.failures[1].exit_code == 3
    assert result.workers[0].state is WorkerState.STOPPED
    assert backend.handles[0].signals == ["ABORT"] and wall_s < 1
    assert "| boom" in result.error_message()
    assert "rank(s) [1] failed: stopping what is left of rank(s) [0] with SIGUSR1, at once" in caplog.text


def test_a_rank_that_holds_the_abort_back_is_killed_after_the_grace(tmp_path):
    backend = FakeBackend(FAILING_RANK_1, ignore_abort=[0])  # writing a checkpoint that never ends
    result, wall_s, _ = _run(backend, tmp_path)
    assert backend.handles[0].signals == ["ABORT", "KILL"] and wall_s < 1
    assert result.workers[0].state is WorkerState.STOPPED


def test_a_rank_that_exits_preempted_leaves_the_others_their_preemption_checkpoint(tmp_path):
    """EXIT_PREEMPTED: every rank agreed on a step and saves it; the others are asked with SIGTERM, not aborted."""
    backend = FakeBackend({0: [("ready",), ("hang",)], 1: [("ready",), ("exit", EXIT_PREEMPTED)]})
    _run(backend, tmp_path)
    assert backend.handles[0].signals == ["TERM"]


def test_a_group_stopped_from_outside_is_asked_with_sigterm(tmp_path):
    backend = FakeBackend({0: [("ready",), ("hang",)], 1: [("ready",), ("hang",)]})
    spec = GroupSpec(name="g", entrypoint="trainer.train", num_workers=2, **{**FAST, "hang_timeout_s": 30})
    group = WorkerGroup(spec, backend, tmp_path)
    threading.Timer(0.2, group.stop, args=("a preemption notice",)).start()
    assert group.run().state is GroupState.STOPPED
    assert [h.signals for h in backend.handles] == [["TERM"], ["TERM"]]


def test_secret_values_are_redacted_from_every_log(tmp_path):
    secret = "hunter2-storage-secret"
    backend = FakeBackend({0: [("ready",), ("line", f"key is {secret}"), ("exit", 0)]})
    result, _, lines = _run(backend, tmp_path, num_workers=1, secret_env={"AWS_SECRET_ACCESS_KEY": secret})
    assert result.succeeded and backend.envs[0]["AWS_SECRET_ACCESS_KEY"] == secret
    assert (0, "key is ***") in lines
    assert secret not in (tmp_path / "logs" / "rank-0.log").read_text()


def test_stop_from_another_thread_returns_stopped(tmp_path):
    backend = FakeBackend({0: [("ready",), ("hang",)], 1: [("ready",), ("hang",)]})
    spec = GroupSpec(name="g", entrypoint="trainer.train", num_workers=2, **{**FAST, "hang_timeout_s": 30})
    group = WorkerGroup(spec, backend, tmp_path)
    threading.Timer(0.2, group.stop, args=("test",)).start()
    result = group.run()
    assert result.state is GroupState.STOPPED and not result.failures
    assert all(h.gone() for h in backend.handles)


@pytest.mark.parametrize("code, text", [(-9, "was killed by SIGKILL (signal 9)"), (2, "exited with code 2")])
def test_exit_descriptions_name_the_signal_or_code(tmp_path, code, text):
    result, _, _ = _run(FakeBackend({0: [("ready",), ("exit", code)]}), tmp_path, num_workers=1)
    assert f"rank 0 (host fake-host-0, pid 1000) {text}" in result.error_message()


# -- bounded output (issue 37 item 5, review finding 12) --------------------------------------------------------

def test_a_huge_line_reaches_the_task_log_in_bounded_pieces(tmp_path):
    from launcher import worker_output

    huge = "x" * (3 * worker_output.MAX_LINE_BYTES + 10)
    backend = FakeBackend({0: [("ready",), ("line", huge), ("exit", 0)]})
    result, _, lines = _run(backend, tmp_path, num_workers=1)
    pieces = [line for _, line in lines if line.startswith("x")]
    assert result.succeeded and "".join(pieces) == huge
    assert max(map(len, pieces)) <= worker_output.MAX_LINE_BYTES


def test_a_flood_of_lines_is_bounded_and_never_holds_up_the_watch_loop(tmp_path, monkeypatch):
    """Before: the queue grew without bound and each poll handed on every line before its exit and hang checks."""
    from launcher import group as group_module
    from launcher import worker_output

    monkeypatch.setattr(worker_output, "MAX_QUEUED_LINES", 100)
    monkeypatch.setattr(worker_output, "MAX_LINES_PER_POLL", 20)
    flood = [("line", f"line {i}") for i in range(3000)]
    backend = FakeBackend({0: [("ready",), *flood, ("exit", 0)]})
    spec = GroupSpec(name="g", entrypoint="trainer.train", num_workers=1, **FAST)
    lines: list[str] = []
    handed_at_checks: list[int] = []  # lines handed on when each poll checked for an exit or a hang

    def slow_task_log(rank: int, line: str) -> None:
        """A task log slower than the worker, whatever the machine's load: it takes its first line only once the
        worker printed them all."""
        worker_output = backend.handles[0].output.lines
        deadline = time.monotonic() + 30
        while not lines and not worker_output.empty() and time.monotonic() < deadline:
            time.sleep(0.01)
        lines.append(line)

    check_outcome = group_module.WorkerGroup._outcome

    def counting_outcome(self, *args):
        handed_at_checks.append(len(lines))
        return check_outcome(self, *args)

    monkeypatch.setattr(group_module.WorkerGroup, "_outcome", counting_outcome)
    result = WorkerGroup(spec, backend, tmp_path, on_line=slow_task_log).run()
    assert result.succeeded
    per_poll = [b - a for a, b in zip([0, *handed_at_checks], handed_at_checks, strict=False)]
    assert handed_at_checks and max(per_poll) <= 20  # not every queued line before the exit check
    assert any("left out of the task log" in line for line in lines) and len(lines) < 3000
    assert (tmp_path / "logs" / "rank-0.log").read_text().count("\nline ") == 3000  # the rank's log has them all
