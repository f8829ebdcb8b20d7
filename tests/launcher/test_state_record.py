"""The run-state record is read whole and typed: what a launch writes reads back to the same JSON, the backends'
own keys included, and a record of another shape is refused naming the file and the field."""

import json

import pytest

from core.document import DocumentError
from launcher.state_record import RecordedWorker, SlotsCheck, StateRecord

WRITTEN = {
    "task_id": "train", "backend": "ssh", "state": "succeeded", "updated_at": "2026-12-05T07:00:00.123Z",
    "workdir": "/tmp/tfmw-train-abc",
    "launcher": {"hostname": "h", "boot_id": "b", "pid_namespace": "pid:[1]", "mount_namespace": "mnt:[2]"},
    "workers": [{"rank": 0, "host": "10.0.0.2", "port": 41000, "gpus": [0], "gpu_idle_mb": {"0": 615},
                 "conn_id": "gpu_a", "remote_pid": 71, "remote_pgid": 71},
                {"rank": 1, "host": "10.0.0.3", "port": 41001, "gpus": ["GPU-5e1f"], "gpu_idle_mb": {"GPU-5e1f": 615},
                 "conn_id": "gpu_b", "remote_pid": 72, "remote_pgid": 72}],
    "after_exit": {"checked": True, "free": True, "free_after_s": 0.25, "release_after_train_s": 0.3, "slots": "gpu",
                   "hosts": {"gpu_a": {"free": True}}},
}


def test_a_written_record_reads_back_to_the_same_json():
    record = StateRecord.from_json(WRITTEN, "state/train.json")
    assert record.workers[1].gpus == ("GPU-5e1f",) and record.workers[0].handle_id("remote_pid") == 71
    assert record.workers[1].gpu_idle_mb == {"GPU-5e1f": 615}
    assert record.after_exit.proven and record.after_exit.evidence["slots"] == "gpu"
    assert json.dumps(record.to_json(), sort_keys=True) == json.dumps(WRITTEN, sort_keys=True)


@pytest.mark.parametrize(("change", "named"), [
    ({"workers": [{"rank": 0, "host": "h", "port": "41000"}]}, "workers[0].port: expected"),
    ({"workdir": 7}, "workdir: expected str"),
    ({"workers": [{"rank": 0, "host": "h", "port": 1, "gpu_idle_mb": {"GPU-a": "615"}}]}, "workers[0].gpu_idle_mb"),
    ({"after_exit": {"free": True}}, "after_exit: missing key(s) checked"),
    ({"launcher": ["h"]}, "launcher: expected"),
])
def test_a_record_of_another_shape_is_refused_naming_the_file_and_the_field(change, named):
    with pytest.raises(DocumentError, match="state/train.json") as refused:
        StateRecord.from_json({**WRITTEN, **change}, "state/train.json")
    assert named in str(refused.value)


def test_a_handle_id_is_an_integer_or_nothing():
    worker = RecordedWorker(0, "h", None, extra={"pid": 12, "pgid": True, "remote_pid": "12"})
    assert (worker.handle_id("pid"), worker.handle_id("pgid"), worker.handle_id("remote_pid")) == (12, None, None)
    assert worker.handle_id("absent") is None


def test_a_check_that_failed_proves_nothing_and_says_why():
    failed = SlotsCheck.failed("the check failed: timeout")
    assert not failed.checked and not failed.proven and failed.evidence == {"note": "the check failed: timeout"}
    assert failed.to_json() == {"checked": False, "free": None, "free_after_s": None, "release_after_train_s": None,
                                "note": "the check failed: timeout"}
