"""The shard cache's locks and eviction: datasets held by real processes, the disk's size simulated (its free space is
its capacity less what the cache holds), so that eviction runs without filling a real disk."""

from __future__ import annotations

import hashlib
import os
import shutil
import signal
import subprocess
import sys
import time
from collections import namedtuple
from pathlib import Path

import pytest

from tests.conftest import REPO
from trainer import shard_cache

MIB = 1 << 20
Usage = namedtuple("Usage", "total used free")


def fingerprint(name: str) -> str:
    """A dataset's directory name in the cache, as prepare names datasets (core.layout.DATASET_FINGERPRINT)."""
    return hashlib.sha256(name.encode()).hexdigest()[:20]


def _dataset(root: Path, name: str, size: int, idle_s: float) -> Path:
    directory = root / fingerprint(name)
    directory.mkdir(parents=True, mode=0o700)
    with open(directory / "train-00000-of-00001.tfrecord", "wb") as shard:
        shard.truncate(size)  # sparse: the size counts, the disk is not used
    last_use = time.time() - idle_s
    os.utime(directory, (last_use, last_use))
    return directory


@pytest.fixture
def disk(monkeypatch, tmp_path):
    """A disk of `capacity` bytes holding only the cache under tmp_path/cache; no margin, to keep the sums plain."""
    root = tmp_path / "cache"
    root.mkdir(mode=0o700)
    state = {"capacity": 0}

    def usage(path):
        used = sum(f.stat().st_size for f in root.rglob("*") if f.is_file())
        return Usage(state["capacity"], used, state["capacity"] - used)

    monkeypatch.setattr(shard_cache.shutil, "disk_usage", usage)
    monkeypatch.setattr(shard_cache, "DISK_MARGIN_BYTES", 0)
    return root, state


def _hold_elsewhere(cache: Path) -> subprocess.Popen:
    """Another worker holding `cache`: a real process, so that only its exit releases the lock."""
    program = ("import sys, time\nfrom pathlib import Path\nfrom trainer import shard_cache\n"
               "shard_cache.hold(Path(sys.argv[1]))\nprint('held', flush=True)\ntime.sleep(120)")
    holder = subprocess.Popen([sys.executable, "-c", program, str(cache)], cwd=REPO, stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"
    return holder


def test_idle_datasets_make_room_least_recently_used_first_and_one_in_use_never(disk):
    root, state = disk
    _dataset(root, "oldest", 10 * MIB, idle_s=3 * 86400)
    held = _dataset(root, "held", 10 * MIB, idle_s=2 * 86400)
    _dataset(root, "recent", 10 * MIB, idle_s=86400)
    current = _dataset(root, "current", 0, idle_s=0)
    state["capacity"] = 32 * MIB  # 2 MiB free
    holder = _hold_elsewhere(held)
    try:
        # 12 MiB asked: one dataset is enough
        assert shard_cache.make_room(current, 10 * MIB) == [fingerprint("oldest")]
        assert shard_cache.make_room(current, 10 * MIB) == []
        # 30 MiB asked: the held one stays anyway
        assert shard_cache.make_room(current, 25 * MIB) == [fingerprint("recent")]
        assert sorted(p.name for p in root.iterdir()) == sorted([current.name, held.name])
        assert shard_cache.reclaimable_bytes(root, keep=current.name) == 0
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    assert shard_cache.reclaimable_bytes(root, keep=current.name) == 10 * MIB  # its lock died with it
    assert shard_cache.make_room(current, 25 * MIB) == [held.name]


def test_holding_marks_the_last_use_and_recreates_a_dataset_evicted_meanwhile(disk):
    root, _ = disk
    cache = _dataset(root, "fp", MIB, idle_s=86400)
    shutil.rmtree(cache)  # another worker evicted it after this one found it
    shard_cache.hold(cache)
    assert cache.is_dir() and time.time() - cache.stat().st_mtime < 60
    assert shard_cache.missing_bytes(cache, [{"name": "a", "bytes": 5}, {"name": "b", "bytes": 7}]) == 12
    (cache / "a").write_bytes(b"12345")
    assert shard_cache.missing_bytes(cache, [{"name": "a", "bytes": 5}, {"name": "b", "bytes": 7}]) == 7


def test_eviction_removes_only_datasets_beside_the_cache(disk):
    """What else lies in the cache's directory is never removed, however much room is asked for (review t4 #1: a
    crafted fingerprint of `../../victim/x` made `make_room` empty every directory under victim/)."""
    root, state = disk
    idle = _dataset(root, "idle", MIB, idle_s=86400)
    for name in (".ssh", "project", "0123"):
        (root / name).mkdir(mode=0o700)
    current = _dataset(root, "current", 0, idle_s=0)
    state["capacity"] = MIB
    assert shard_cache.make_room(current, 10**18) == [idle.name]
    assert sorted(p.name for p in root.iterdir()) == sorted([".ssh", "0123", "project", current.name])
