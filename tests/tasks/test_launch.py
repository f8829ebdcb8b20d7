"""tasks.launch: every task's worker group run with its state record, its logs in storage and no work directory
left, on the fake backend (scripted workers, no processes) and storage on local disk."""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path

import pytest

from core.layout import StorageLayout
from core.storage import exists, join, read_json
from launcher import GroupSpec, GroupState
from tasks.launch import RecordedLaunch
from tests.launcher.fake_backend import FakeBackend


def spec(**changes) -> GroupSpec:
    return GroupSpec(**{"name": "evaluate-distributed", "entrypoint": "trainer.evaluate", "num_workers": 2,
                        "run_key": "run-1", "startup_timeout_s": 5, "hang_timeout_s": 5, "grace_period_s": 0.2,
                        **changes})


def scripts(exit_code: int = 0):
    return {rank: [("ready",), ("line", f"rank {rank} working"), ("exit", exit_code if rank else 0)]
            for rank in range(2)}


def test_a_group_is_recorded_while_it_runs_and_at_its_end(tmp_path):
    run = StorageLayout(str(tmp_path / "storage")).run("run-1")
    records, lines = [], []
    launch = RecordedLaunch(spec(), FakeBackend(scripts()), run, on_line=lambda rank, line: lines.append(line),
                            on_record=records.append)
    workdir = launch.workdir
    result = launch.run_group()

    assert result.succeeded and ("rank 1 working" in lines)
    assert [record.state for record in records] == ["running", "succeeded"]
    assert records[0].after_exit is None and records[-1].after_exit.checked is False  # the fake backend proves nothing
    stored = read_json(run.state_file("evaluate-distributed"))
    assert stored == records[-1].to_json() and stored["backend"] == "fake" and stored["workdir"] == str(workdir)
    assert stored["after_exit"] == {"checked": False, "free": None, "free_after_s": None, "release_after_train_s": None,
                                    "note": "the fake backend proves its slots free at the run's release only"}
    assert [(w["rank"], w["host"], w["fake_pid"]) for w in stored["workers"]] == [(0, "fake-host-0", 1000),
                                                                                  (1, "fake-host-1", 1001)]
    assert exists(join(run.logs("evaluate-distributed"), "rank-1.log"))
    assert not Path(workdir).exists()
    assert launch.label(1) == "rank 1"  # the fake backend's handles keep the default label


def test_a_failed_or_stopped_group_is_recorded_as_such(tmp_path):
    run = StorageLayout(str(tmp_path / "storage")).run("run-1")
    failed = RecordedLaunch(spec(), FakeBackend(scripts(exit_code=3)), run, on_line=lambda *_: None).run_group()
    assert failed.state is GroupState.FAILED
    assert read_json(run.state_file("evaluate-distributed"))["state"] == "failed"

    hanging = {rank: [("ready",), ("hang",)] for rank in range(2)}
    launch = RecordedLaunch(spec(name="train"), FakeBackend(hanging), run, on_line=lambda *_: None,
                            on_record=lambda record: record.state == "running" and launch.stop("killed", 0.1))
    launch.run_group(stopped=lambda: True)
    assert read_json(run.state_file("train"))["state"] == "stopped"


def test_storage_that_fails_at_the_end_hides_no_failure_and_fails_a_success(tmp_path, caplog):
    run = StorageLayout(str(tmp_path / "storage")).run("run-1")
    written = []

    @contextlib.contextmanager
    def storage():
        written.append(1)
        if len(written) > 1:  # the start's record is written; the end's storage is gone
            raise OSError("storage unreachable")
        yield

    with caplog.at_level(logging.ERROR, logger="gpt_finetune.launch"):
        result = RecordedLaunch(spec(), FakeBackend(scripts(exit_code=3)), run, on_line=lambda *_: None,
                                storage=storage).run_group()
    assert result.state is GroupState.FAILED and "could not record the final state" in caplog.text

    written.clear()
    launch = RecordedLaunch(spec(), FakeBackend(scripts()), run, on_line=lambda *_: None, storage=storage)
    with pytest.raises(OSError, match="storage unreachable"):
        launch.run_group()
    assert not Path(launch.workdir).exists()


def test_the_record_names_the_launcher_host_and_an_unfinished_attempt_elsewhere_is_named(tmp_path, caplog):
    """Release and the sweep of earlier attempts see only their own host: every record names its launcher's host
    identity, and a retry launched elsewhere than an attempt that never finished says so, naming both hosts."""
    from core.storage import write_json_atomic
    from launcher.host_identity import host_identity

    run = StorageLayout(str(tmp_path / "storage")).run("run-1")
    elsewhere = {**host_identity(), "hostname": "gpu-host-7", "boot_id": "0f0e0d0c-0000-4000-8000-000000000007"}
    write_json_atomic(run.state_file("train"), {"task_id": "train", "backend": "local", "state": "running",
                                                "updated_at": "2026-12-05T07:00:00.000Z", "workdir": "",
                                                "launcher": elsewhere, "workers": []})
    backend = FakeBackend(scripts())
    backend.name = "local"  # a local group: its workers run beside its launcher
    with caplog.at_level(logging.WARNING, logger="gpt_finetune.launch"):
        RecordedLaunch(spec(name="train"), backend, run, on_line=lambda *_: None).run_group()
    assert read_json(run.state_file("train"))["launcher"] == host_identity()
    warning = caplog.text
    assert "An earlier attempt of train" in warning and "launched on gpu-host-7 (boot 0f0e0d0c" in warning
    assert f"this attempt runs on {host_identity()['hostname']} " in warning and "set gpu_queue" in warning

    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="gpt_finetune.launch"):  # its own record: same host, finished
        RecordedLaunch(spec(name="train"), FakeBackend(scripts()), run, on_line=lambda *_: None).run_group()
    assert "earlier attempt" not in caplog.text


def test_a_slots_check_of_another_shape_is_evidence_of_nothing_and_names_the_field(tmp_path, caplog):
    """A backend's answer (an SSH agent's, say) with a mistyped field proves nothing; a state record whose after_exit
    is mistyped gives no release_after_train_s."""
    from core.storage import write_json_atomic
    from tasks.launch import release_after_exit

    class Answers(FakeBackend):
        def check_slots_free(self, group, workers):
            return {"checked": True, "free": "yes", "free_after_s": 0.1, "slots": "cpu"}

    run = StorageLayout(str(tmp_path / "storage")).run("run-1")
    launch = RecordedLaunch(spec(name="train"), Answers(scripts()), run, on_line=lambda *_: None)
    with caplog.at_level(logging.WARNING, logger="gpt_finetune.launch"):
        launch.run_group()
    assert launch.after_exit.checked is False and launch.after_exit.release_after_train_s is None
    assert "free: expected bool, got str 'yes'" in launch.after_exit.evidence["note"]
    assert release_after_exit(run, "train") is None
    record = read_json(run.state_file("train"))
    write_json_atomic(run.state_file("train"), {**record, "after_exit": {"checked": True, "free": True,
                                                                         "free_after_s": 0.2,
                                                                         "release_after_train_s": 0.3}})
    assert release_after_exit(run, "train") == 0.3
    write_json_atomic(run.state_file("train"), {**record, "after_exit": {"checked": True, "free": True,
                                                                         "release_after_train_s": "fast"}})
    with caplog.at_level(logging.INFO, logger="gpt_finetune.launch"):
        assert release_after_exit(run, "train") is None
    assert "after_exit.release_after_train_s: expected" in caplog.text
