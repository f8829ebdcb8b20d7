"""Publishing as a transaction: a stage killed anywhere, or storage failing midway, leaves no manifest, and the
next run of the same dataset cleans up and starts over (local roots and S3 alike)."""

from __future__ import annotations

import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from core import storage
from core.config import RunConfig
from tasks.dataset.errors import PrepareError
from tasks.dataset.stage import identify_dataset, prepare_dataset
from tests.tasks.dataset.corpus import REPO, config, dataset_files, dataset_names

pytest_plugins = ["tests.support.s3server"]


def start_prepare_process(cfg: RunConfig, log_path: Path) -> subprocess.Popen:
    code = (
        "import json, logging, sys\n"
        "logging.basicConfig(level=logging.INFO)\n"
        "from core.config import RunConfig\n"
        "from tasks.dataset.stage import prepare_dataset\n"
        "prepare_dataset(RunConfig.from_saved(json.loads(sys.argv[1])))\n"
    )
    with open(log_path, "wb") as log_file:
        return subprocess.Popen([sys.executable, "-c", code, cfg.to_json()], stdout=log_file,
                                stderr=subprocess.STDOUT, cwd=REPO)


def wait_for(condition, process: subprocess.Popen, log_path: Path, timeout: float = 300.0) -> None:
    """Poll `condition` while the process runs; generous timeout: a loaded CI machine starts Python slowly."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert process.poll() is None, f"prepare ended early:\n{log_path.read_text()}"
        assert time.monotonic() < deadline, f"timed out waiting; log:\n{log_path.read_text()}"
        time.sleep(0.005)


@pytest.mark.parametrize("tasks", [1, 2])
def test_killed_local_run_leaves_no_manifest_and_the_next_run_starts_clean(tmp_path, tasks, monkeypatch):
    """Killed once it has a tokenizer for its units: in a temporary directory (one task: its process is gone, so the
    next run removes it) or in the storage root's work directory (mapped tasks: no process to ask, so the next run
    removes it once nothing was written there for LEFTOVER_AGE_S; a younger one may be another run's, live)."""
    cfg = config(tmp_path, prepare_tasks=tasks)
    fingerprint = identify_dataset(cfg).fingerprint
    datasets_dir = Path(cfg.storage_root) / "datasets"
    work = Path(tempfile.gettempdir()) if tasks == 1 else datasets_dir / ".work" / fingerprint
    pattern = f"prepare-{fingerprint}-*/tokenizer/tokenizer.json" if tasks == 1 else "*/tokenizer/tokenizer.json"
    process = start_prepare_process(cfg, tmp_path / "prepare.log")
    try:
        wait_for(lambda: list(work.glob(pattern)), process, tmp_path / "prepare.log")
    finally:
        process.send_signal(signal.SIGKILL)
        process.wait()
    assert not list(datasets_dir.glob("*/manifest.json"))

    if tasks == 2:
        from tasks.dataset import publish

        monkeypatch.setattr(publish, "LEFTOVER_AGE_S", -1.0)  # as if a day had passed
    result = prepare_dataset(cfg)
    assert not result.cache_hit
    assert not list(datasets_dir.glob(".*.partial-*"))
    assert not (datasets_dir / ".work" / fingerprint).exists()
    assert [p.name for p in datasets_dir.iterdir() if p.name != ".work"] == [result.fingerprint]
    assert not [p for p in Path(tempfile.gettempdir()).glob(f"prepare-{fingerprint}-{process.pid}-*")]


def test_killed_upload_leaves_no_manifest_and_the_next_run_starts_clean(tmp_path, s3_faults, s3_faulty_bucket):
    cfg = config(tmp_path, storage_root=f"{s3_faulty_bucket}/store")
    s3_faults.hold_at(4)
    process = start_prepare_process(cfg, tmp_path / "prepare.log")
    try:
        wait_for(s3_faults.held.is_set, process, tmp_path / "prepare.log")
    finally:
        process.send_signal(signal.SIGKILL)
        process.wait()
    s3_faults.heal()
    fingerprint = identify_dataset(cfg).fingerprint
    # Names only: an object whose upload the kill cut off may not even read back (checksum mismatch).
    partial = dataset_names(f"{cfg.storage_root}/datasets/{fingerprint}/manifest.json")
    assert partial and "manifest.json" not in partial

    result = prepare_dataset(cfg)
    manifest = storage.read_json(result.manifest_url)
    listed = {s["name"] for split in manifest["splits"].values() for s in split["shards"]}
    listed |= {f"tokenizer/{f['name']}" for f in manifest["tokenizer"]["files"]} | {"manifest.json"}
    assert set(dataset_files(result.manifest_url)) == listed


def test_object_store_failing_midway_publishes_nothing(tmp_path, s3_faults, s3_faulty_bucket):
    cfg = config(tmp_path, storage_root=f"{s3_faulty_bucket}/store")
    s3_faults.fail_after(5)
    with pytest.raises(PrepareError, match=r"Writing the dataset to s3://.* failed .*No manifest was written"):
        prepare_dataset(cfg)
    assert s3_faults.failed_puts >= 1
    fingerprint = identify_dataset(cfg).fingerprint
    assert not storage.exists(f"{cfg.storage_root}/datasets/{fingerprint}/manifest.json")

    s3_faults.heal()
    result = prepare_dataset(cfg)
    assert not result.cache_hit and storage.exists(result.manifest_url)
