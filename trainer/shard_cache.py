"""Each host's shard cache (`trainer.data.shard_cache_dir`): held while in use, emptied of idle datasets for room.

A dataset's shards stay cached on a host so that retries, the baseline and the next nightly run skip the download;
nothing else ever removes them, so every dataset a host trained on would stay until its disk is full. A worker
therefore holds a shared lock on its dataset's directory from staging until it exits (the kernel drops the lock
however the process ends), and before it stages it makes room: when the disk lacks what its missing shards need,
datasets that no process holds go, least recently used first. A dataset in use is never removed.
"""

from __future__ import annotations

import fcntl
import logging
import os
import shutil
from pathlib import Path
from typing import Any

from core.layout import DATASET_FINGERPRINT
from trainer.data import DataError, private_dir

log = logging.getLogger("trainer.shard_cache")

# Free space kept beyond the shards themselves (logs, checkpoints, the model staged beside them).
DISK_MARGIN_BYTES = 256 << 20
HOLD_ATTEMPTS = 3
_held: list[int] = []  # descriptors of the directories this process holds: open until it exits


def hold(cache: Path) -> None:
    """Lock `cache` (one dataset's directory, made by `shard_cache_dir`) shared for the rest of this process, and
    mark it used now: `make_room` elsewhere never removes it meanwhile."""
    for _ in range(HOLD_ATTEMPTS):
        descriptor = _open_dir(cache)
        if descriptor is not None:
            fcntl.flock(descriptor, fcntl.LOCK_SH)  # waits while another process is removing it
            try:
                same = os.stat(cache, follow_symlinks=False).st_ino == os.fstat(descriptor).st_ino
            except FileNotFoundError:
                same = False
            if same:
                os.utime(cache)  # the last use, which orders eviction
                _held.append(descriptor)
                return
            os.close(descriptor)
        private_dir(cache.parent)  # another process evicted it after it was created: create it again
        private_dir(cache)
    raise DataError(f"shard cache {cache} was removed {HOLD_ATTEMPTS} times while this worker locked it: another "
                    "process keeps evicting it. Give the host more disk or train fewer datasets on it at once.")


def missing_bytes(cache: Path, shards: list[dict[str, Any]]) -> int:
    """What staging `shards` into `cache` still has to download (a copy of the right size counts as there; staging
    checks its sha256)."""
    def present(shard: dict[str, Any]) -> bool:
        try:
            return (cache / shard["name"]).stat().st_size == shard["bytes"]
        except FileNotFoundError:
            return False

    return sum(shard["bytes"] for shard in shards if not present(shard))


def room_for(download_bytes: int) -> int:
    """The free space staging a download of this size asks for: 20% slack and the margin."""
    return int(download_bytes * 1.2) + DISK_MARGIN_BYTES


def make_room(cache: Path, download_bytes: int) -> list[str]:
    """Remove idle datasets beside `cache`, least recently used first, until `room_for(download_bytes)` is free on
    its disk; returns the fingerprints removed. Datasets that a process holds stay, whatever room that leaves."""
    evicted: list[str] = []
    for other in _by_last_use(cache.parent, keep=cache.name):
        if shutil.disk_usage(cache).free >= room_for(download_bytes):
            break
        size = _idle_size(other, remove=True)
        if size is not None:
            evicted.append(other.name)
            log.info("shard cache: removed idle dataset %s (%.1f MiB) to make room for %s", other.name, size / 2**20,
                     cache.name)
    return evicted


def reclaimable_bytes(root: Path, keep: str) -> int:
    """What `make_room` could free under `root` (this user's cache) now: the idle datasets other than `keep`."""
    return sum(size for other in _by_last_use(root, keep=keep) if (size := _idle_size(other)) is not None)


def _by_last_use(root: Path, keep: str) -> list[Path]:
    dated = []
    for entry in os.scandir(root) if root.is_dir() else ():
        # Only datasets are ever removed: whatever else lies beside them is not this cache's to judge.
        if entry.name == keep or not DATASET_FINGERPRINT.fullmatch(entry.name) or not entry.is_dir(
                follow_symlinks=False):
            continue
        try:
            dated.append((entry.stat(follow_symlinks=False).st_mtime, Path(entry.path)))
        except FileNotFoundError:
            continue
    return [path for _, path in sorted(dated)]


def _open_dir(path: Path) -> int | None:
    try:
        return os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except OSError:  # gone, or not a real directory
        return None


def _idle_size(directory: Path, remove: bool = False) -> int | None:
    """The size of `directory` in bytes if no process holds it (and then removed, with `remove`); else None."""
    descriptor = _open_dir(directory)
    if descriptor is None:
        return None
    try:
        try:
            fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:  # held by a running worker
            return None
        size = _tree_bytes(directory)
        if remove:
            # Under our lock: a worker about to hold it waits, then retries.
            shutil.rmtree(directory, ignore_errors=True)
        return size
    finally:
        os.close(descriptor)


def _tree_bytes(directory: Path) -> int:
    total = 0
    for base, _, names in os.walk(directory):
        for name in names:
            try:
                total += os.lstat(os.path.join(base, name)).st_size
            except FileNotFoundError:
                continue
    return total
