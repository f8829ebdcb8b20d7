"""Release ends every process of the run (recorded or not, stubborn or not), proves it, and is idempotent."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tasks.release import ReleaseError, processes_of_run, release_run
from tests.hardware import assert_gpu_check_matches_this_machine
from trainer.layout import StorageLayout, run_key
from trainer.storage import write_json_atomic

RUN_ID = "manual__2026-11-29T02:00:00+00:00"
KEY = run_key(RUN_ID)

STUBBORN = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"
WITH_CHILD = (
    "import subprocess, sys, time; "
    "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)']); time.sleep(600)"
)


def start(code: str, key: str = KEY, **kwargs) -> subprocess.Popen:
    env = dict(os.environ, TFMW_RUN_KEY=key)
    return subprocess.Popen([sys.executable, "-c", code], env=env, start_new_session=True, **kwargs)


def wait_for(predicate, timeout=10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.1)
    return False


@pytest.fixture
def processes():
    started = []
    yield started
    for proc in started:
        try:
            os.killpg(proc.pid, 9)
        except ProcessLookupError:
            pass
        proc.wait()


def test_release_ends_recorded_unrecorded_stubborn_and_grandchildren(tmp_path, processes):
    root = str(tmp_path / "storage")
    run = StorageLayout(root).run(KEY)
    recorded = start("import time; time.sleep(600)")
    stubborn = start(STUBBORN)
    parent = start(WITH_CHILD)
    other_run = start("import time; time.sleep(600)", key="some_other_run")
    processes += [recorded, stubborn, parent, other_run]
    workdir = tmp_path / "rank-0"
    workdir.mkdir()
    write_json_atomic(run.state_file("train"), {
        "task_id": "train", "backend": "local", "state": "failed", "workdir": str(workdir),
        "workers": [{"rank": 0, "host": "localhost", "pid": recorded.pid, "pgid": recorded.pid, "port": 1,
                     "gpus": []}],
    })
    assert wait_for(lambda: len(processes_of_run(KEY)) == 4)  # recorded, stubborn, parent and its child

    started = time.monotonic()
    result = release_run({"storage_root": root}, RUN_ID, grace_period_s=2.0)
    elapsed = time.monotonic() - started

    assert result["clean"] is True
    assert processes_of_run(KEY) == {}
    assert stubborn.pid in result["killed"]  # ignored SIGTERM, needed SIGKILL after the grace period
    assert elapsed < 10
    assert other_run.poll() is None  # another run's worker is untouched
    assert not workdir.exists()
    report = json.loads(Path(run.release).read_text())
    assert report["state_records"] == ["train.json"]
    assert report["clean"] and report["survivors"] == []
    assert_gpu_check_matches_this_machine(report["gpu_check"])


def test_release_is_idempotent_and_survives_invalid_settings(tmp_path):
    root = str(tmp_path / "storage")
    params = {"storage_root": root, "num_workers": 0, "bogus": 1}  # the run that prepare refused
    first = release_run(params, RUN_ID)
    second = release_run(params, RUN_ID)
    assert first["clean"] and second["clean"]
    assert first["terminated"] == second["terminated"] == []
    assert os.path.exists(StorageLayout(root).run(KEY).release)


def test_unreleasable_process_fails_the_task(tmp_path, processes, monkeypatch):
    proc = start("import time; time.sleep(600)")
    processes.append(proc)
    assert wait_for(lambda: proc.pid in processes_of_run(KEY))
    monkeypatch.setattr("tasks.release._signal_all", lambda pids, sig: [])  # a process that cannot be signalled
    with pytest.raises(ReleaseError, match=f"survivors \\[{proc.pid}\\]"):
        release_run({"storage_root": str(tmp_path)}, RUN_ID, grace_period_s=0.5)
