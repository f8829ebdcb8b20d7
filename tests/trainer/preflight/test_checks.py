"""trainer/preflight/checks.py: what one worker checks alone, without TensorFlow."""

from __future__ import annotations

import platform
import shutil
from importlib import metadata
from pathlib import Path

from core.config import RunConfig
from core.protocol import HOST_TMPDIR_ENV
from core.storage import read_json
from tests.support.hardware import nvidia_gpus
from tests.trainer.preflight import workers
from trainer.preflight import checks


def test_worker_checks_pass_on_a_good_setup(tmp_path, monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)  # every GPU of the machine is visible
    paths = workers.dataset(tmp_path, num_workers=2)
    cfg = RunConfig.from_saved(read_json(paths["config"]))
    report = checks.check_worker(cfg, paths["manifest"], workers.identity(1, 2))
    assert report["errors"] == []
    assert report["manifest"] == {"ok": True, "fingerprint": workers.FINGERPRINT, "shards": 2, "shard_bytes": 256}
    assert report["storage"]["ok"] and report["disk"]["free_bytes"] > report["disk"]["needed_bytes"]
    installed = {package: metadata.version(package) for package in ("tensorflow", "tf-keras", "transformers", "numpy")}
    assert report["versions"] == {"python": platform.python_version(), **installed}
    assert [(gpu["index"], gpu["name"]) for gpu in report["devices"]["gpus"]] == nvidia_gpus()
    assert not (tmp_path / ".preflight").exists() or not any((tmp_path / ".preflight").iterdir())


def test_worker_checks_name_each_problem_and_the_setting(tmp_path, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # as the launcher pins a worker given no GPU, on any machine
    paths = workers.dataset(tmp_path, num_workers=2)
    blocker = tmp_path / "a-file"
    blocker.write_text("a file where storage_root needs a directory: not writable, even by root")
    cfg = RunConfig(num_workers=3, use_gpu=True, storage_root=str(blocker / "root"))
    (Path(paths["manifest"]).parent / "train-00003-of-00004.tfrecord").unlink()
    report = checks.check_worker(cfg, paths["manifest"], workers.identity(1, 2))
    errors = "\n".join(report["errors"])
    assert "rank 1 on host-a (127.0.0.1:5001): TF_CONFIG lists 2 workers but num_workers=3" in errors
    assert "use_gpu is true but no GPU is visible" in errors and "set use_gpu to false" in errors
    assert "shard(s) ['train-00003-of-00004.tfrecord'] listed in" in errors
    assert f"rank 1 on host-a (127.0.0.1:5001): cannot write to storage_root {blocker / 'root'}: " in errors
    assert report["storage"]["ok"] is False and blocker.read_text().startswith("a file where")
    missing = checks.check_worker(cfg, str(tmp_path / "nope.json"), workers.identity())["errors"]
    assert any("cannot read the manifest" in e and "nope.json" in e for e in missing)


def test_the_disk_check_counts_cached_datasets_no_worker_holds_as_room(tmp_path, monkeypatch):
    from collections import namedtuple

    from trainer.data import shard_cache_root

    monkeypatch.setenv(HOST_TMPDIR_ENV, str(tmp_path / "host-tmp"))
    paths = workers.dataset(tmp_path, num_workers=2)
    cfg = RunConfig.from_saved(read_json(paths["config"]))
    idle = shard_cache_root() / ("ab" * 10)  # another dataset, named as prepare names them
    idle.mkdir(parents=True)
    with open(idle / "train-00000-of-00001.tfrecord", "wb") as shard:
        shard.truncate(1 << 30)  # sparse
    monkeypatch.setattr(shutil, "disk_usage", lambda path: namedtuple("Usage", "total used free")(0, 0, 100 << 20))
    report = checks.check_worker(cfg, paths["manifest"], workers.identity(1, 2))
    assert report["errors"] == [] and report["disk"]["reclaimable_bytes"] == 1 << 30
    shutil.rmtree(idle)
    [error] = checks.check_worker(cfg, paths["manifest"], workers.identity(1, 2))["errors"]
    assert "has 100 MiB free and 0 MiB of idle cached datasets, shard staging needs about 256 MiB" in error
