"""core.storage on local disk and on the S3 server alike: reads, atomic writes, trees, listings, and the endpoint
taken from the environment."""

from __future__ import annotations

import hashlib
import os
import threading
from pathlib import Path

import pytest

from core import storage


def test_bytes_and_json_round_trip_with_ranged_reads(root):
    url = storage.join(root, "runs", "r1", "blob.bin")
    assert not storage.exists(url)
    storage.write_bytes_atomic(url, b"0123456789")
    assert storage.exists(url)
    assert storage.read_bytes(url) == b"0123456789"
    assert storage.read_range(url, 2, 5) == b"234"
    storage.write_json_atomic(storage.join(root, "runs", "r1", "state.json"), {"b": 1, "a": [1, 2]})
    assert storage.read_json(storage.join(root, "runs", "r1", "state.json")) == {"a": [1, 2], "b": 1}


def test_trees_round_trip_and_are_listed_and_removed(root, tmp_path):
    source = tmp_path / "source"
    for name in ("model/weights.h5", "model/config.json", "report.json"):
        (source / name).parent.mkdir(parents=True, exist_ok=True)
        (source / name).write_text(name)
    url = storage.join(root, "outputs")
    assert storage.upload_tree(source, url) == [storage.join(url, name)
                                                 for name in ("model/config.json", "model/weights.h5", "report.json")]
    assert list(storage.list_dir(url)) == ["model", "report.json"]
    copied = storage.download_tree(url, tmp_path / "copy")
    assert sorted(path.relative_to(tmp_path / "copy").as_posix() for path in copied) == [
        "model/config.json", "model/weights.h5", "report.json"]
    assert all(path.read_text() == path.relative_to(tmp_path / "copy").as_posix() for path in copied)
    storage.remove_tree(storage.join(url, "model"))
    assert list(storage.list_dir(url)) == ["report.json"]


def test_missing_trees_are_empty_not_errors(root, tmp_path):
    missing = storage.join(root, "never-written")
    assert list(storage.list_dir(missing)) == []
    assert storage.download_tree(missing, tmp_path / "copy") == []
    storage.remove_tree(missing)
    assert storage.upload_tree(tmp_path / "empty-dir-that-does-not-exist", missing) == []


def test_single_files_go_up_and_down(root, tmp_path):
    local = tmp_path / "shard.bin"
    local.write_bytes(os.urandom(4096))
    url = storage.join(root, "shards", "deep", "shard.bin")
    storage.upload_file(local, url)
    storage.download_file(url, tmp_path / "back" / "shard.bin")
    assert (tmp_path / "back" / "shard.bin").read_bytes() == local.read_bytes()
    assert storage.sha256_file(local) == hashlib.sha256(local.read_bytes()).hexdigest()


def test_a_files_sha256_spans_every_buffer_it_is_read_in(tmp_path):
    """A file of several read buffers and a ragged tail: the digest is that of all its bytes."""
    data = os.urandom(3 * (1 << 20) + 12345)
    (tmp_path / "shard.bin").write_bytes(data)
    assert storage.sha256_file(tmp_path / "shard.bin") == hashlib.sha256(data).hexdigest()
    (tmp_path / "empty.bin").write_bytes(b"")
    assert storage.sha256_file(tmp_path / "empty.bin") == hashlib.sha256(b"").hexdigest()


def test_readers_see_the_old_or_the_new_object_never_a_part(root):
    """A reader racing overwrites (a 2 MiB object, and a small one rewritten as often as a rank's heartbeat) always
    reads one complete version, and never fails because the object changed while it read."""
    url = storage.join(root, "latest.bin")
    versions = [bytes([fill]) * (2 << 20) for fill in (1, 2)]
    storage.write_bytes_atomic(url, versions[0])
    small_url = storage.join(root, "rank-1.json")
    storage.write_bytes_atomic(small_url, b"0")
    done = threading.Event()
    torn: list[int] = []
    failures: list[Exception] = []
    small_reads = 0

    def read_while_writing() -> None:
        nonlocal small_reads
        try:
            while not done.is_set():
                data = storage.read_bytes(url)
                if data not in versions:
                    torn.append(len(data))
                storage.read_bytes(small_url)
                small_reads += 1
        except Exception as error:  # noqa: BLE001 - the assertion below names it
            failures.append(error)

    reader = threading.Thread(target=read_while_writing)
    reader.start()
    try:
        for write in range(6):
            storage.write_bytes_atomic(url, versions[write % 2])
            for beat in range(20):
                storage.write_bytes_atomic(small_url, str(beat).encode())
    finally:
        done.set()
        reader.join()
    assert failures == [] and torn == [] and small_reads > 0
    assert storage.read_bytes(url) == versions[1]


def test_a_local_write_that_fails_leaves_the_old_file(tmp_path, monkeypatch):
    url = str(tmp_path / "state.json")
    storage.write_bytes_atomic(url, b"old")

    def disk_full(descriptor: int) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", disk_full)
    with pytest.raises(OSError, match="No space left"):
        storage.write_bytes_atomic(url, b"new")
    assert Path(url).read_bytes() == b"old"


def test_join_keeps_the_scheme_and_normalize_root_makes_roots_absolute(tmp_path):
    assert storage.join("s3://bucket/root/", "/runs/", "r1") == "s3://bucket/root/runs/r1"
    assert storage.join("/data", "a/", "b") == "/data/a/b"
    assert storage.normalize_root("s3://bucket/root/") == "s3://bucket/root"
    assert storage.normalize_root("storage", relative_to=tmp_path) == str((tmp_path / "storage").resolve())
    assert storage.normalize_root(str(tmp_path / "a" / ".." / "b")) == str((tmp_path / "b").resolve())


def test_the_s3_endpoint_comes_from_the_environment(monkeypatch):
    def endpoint(url: str) -> dict:
        return {"client_kwargs": {"endpoint_url": url}}

    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://general:1")
    monkeypatch.delenv("AWS_ENDPOINT_URL_S3", raising=False)
    assert storage.storage_options_from_env("s3://bucket/key") == endpoint("http://general:1")
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", "http://s3-only:2")  # botocore's service-specific name wins
    assert storage.storage_options_from_env("s3://bucket/key") == endpoint("http://s3-only:2")
    assert storage.storage_options_from_env("/local/path") == {}
    monkeypatch.delenv("AWS_ENDPOINT_URL")
    monkeypatch.delenv("AWS_ENDPOINT_URL_S3")
    assert storage.storage_options_from_env("s3://bucket/key") == {}


def test_an_object_store_is_reused_only_under_the_environment_it_was_made_in(s3_bucket):
    url = storage.join(s3_bucket, "runs", "r1")
    first, _ = storage.filesystem(url)
    assert storage.filesystem(storage.join(s3_bucket, "other"))[0] is first  # one botocore client, not one per call
    with pytest.MonkeyPatch.context() as credentials:  # what with_storage_credentials does for a block
        credentials.setenv("AWS_ACCESS_KEY_ID", "another-key")
        assert storage.filesystem(url)[0] is not first
    assert storage.filesystem(url)[0] is first
    assert storage.filesystem(str(Path(url.removeprefix("s3://"))))[0] is not first


def test_a_reused_object_store_sees_what_other_writers_did_since(s3_bucket):
    folder = storage.join(s3_bucket, "shared")
    storage.write_bytes_atomic(storage.join(folder, "a.json"), b"{}")
    assert list(storage.list_dir(folder)) == ["a.json"]
    other_writer = storage.filesystem(folder)[0].__class__(skip_instance_cache=True,
                                                           **storage.storage_options_from_env(folder))
    other_writer.pipe(storage.join(folder, "b.json").removeprefix("s3://"), b"{}")
    assert storage.exists(storage.join(folder, "b.json"))  # no listing cached from the call before
    assert sorted(storage.list_dir(folder)) == ["a.json", "b.json"]
    other_writer.rm(storage.join(folder, "a.json").removeprefix("s3://"))
    assert not storage.exists(storage.join(folder, "a.json"))


def test_a_forked_child_makes_its_own_object_store(s3_bucket):
    url = storage.join(s3_bucket, "forked", "x.json")
    parent_store = storage.filesystem(url)[0]
    reader, writer = os.pipe()
    child = os.fork()
    if child == 0:  # the parent's event loop thread does not exist here: the parent's store would hang
        try:
            if storage.filesystem(url)[0] is parent_store:
                os.write(writer, b"shared")
            else:
                storage.write_bytes_atomic(url, b"from the child")
                os.write(writer, b"ok")
        finally:
            os._exit(0)
    os.close(writer)
    _, status = os.waitpid(child, 0)
    assert (os.read(reader, 16), status) == (b"ok", 0)
    assert storage.read_bytes(url) == b"from the child"


def test_a_published_directory_replaces_the_old_one_whole_with_its_completing_file_last(root):
    url = storage.join(root, "datasets", "abc")
    for version in ("old", "new"):
        with storage.staging_directory(url) as stage:
            (stage / "shards").mkdir()
            (stage / "shards" / f"{version}.bin").write_bytes(version.encode())
            assert not storage.exists(storage.join(url, "shards", f"{version}.bin"))  # nothing shows while staging
            storage.publish_directory(stage, url, last=("manifest.json", version.encode()))
    assert sorted(os.path.relpath(p, storage.filesystem(url)[1])
                  for p in storage.filesystem(url)[0].find(storage.filesystem(url)[1])) == \
        ["manifest.json", os.path.join("shards", "new.bin")]  # the old copy is gone, not merged
    assert storage.read_bytes(storage.join(url, "manifest.json")) == b"new"


def test_a_local_stage_sits_beside_its_target_and_a_killed_builds_leftovers_go(tmp_path):
    url = str(tmp_path / "datasets" / "abc")
    leftover = tmp_path / "datasets" / ".abc.partial-999999-dead"
    leftover.mkdir(parents=True)
    with storage.staging_directory(url) as stage:
        assert stage.parent == Path(url).parent and not leftover.exists()  # same filesystem: one rename
        (stage / "a").write_text("a")
        storage.publish_directory(stage, url)
    assert not stage.exists() and (Path(url) / "a").read_text() == "a"


def test_a_published_file_is_renamed_locally_and_uploaded_to_object_storage(root, tmp_path):
    target = storage.join(root, "streams", "unit-0.bin")
    storage.filesystem(storage.join(root, "streams"))[0].makedirs(storage.filesystem(storage.join(root, "streams"))[1],
                                                                   exist_ok=True)
    staged = tmp_path / "unit-0.bin"
    staged.write_bytes(b"tokens")
    storage.publish_file(staged, target)
    assert storage.read_bytes(target) == b"tokens"


def test_two_builds_of_one_target_keep_each_others_stage(tmp_path):
    """The review's reproduction (finding 11): the second stage's start removed the first, live, one."""
    target = str(tmp_path / "datasets" / "abc123")
    with storage.staging_directory(target) as first:
        (first / "shard").write_bytes(b"a")
        with storage.staging_directory(target) as second:
            assert first.exists() and (first / "shard").read_bytes() == b"a" and second != first
        assert first.exists()


def test_a_stage_of_another_host_goes_only_once_untouched_for_a_day(tmp_path):
    import time

    target = tmp_path / "datasets" / "abc"
    other = tmp_path / "datasets" / ".abc.partial-gpu-host-7-1234-cafe0123"  # a host name with '-' in it
    other.mkdir(parents=True)
    with storage.staging_directory(str(target)):
        assert other.exists()  # its pid means nothing here: it may be live
    day_ago = time.time() - storage.STALE_STAGE_S - 60
    os.utime(other, (day_ago, day_ago))
    with storage.staging_directory(str(target)):
        assert not other.exists()


def test_pid_alive_needs_no_proc():
    assert storage.pid_alive(os.getpid()) and not storage.pid_alive(2 ** 22 + 12345)


def test_a_local_copy_is_the_path_itself_on_this_machine_else_a_download(root, tmp_path):
    tree = storage.join(root, "model")
    storage.write_bytes_atomic(storage.join(tree, "config.json"), b"{}")
    storage.write_bytes_atomic(storage.join(tree, "sub", "weights.bin"), b"w")
    local_root = not root.startswith("s3://")
    scratch = tmp_path / "scratch"

    copy = storage.local_copy(tree, scratch)
    assert copy == (Path(tree) if local_root else scratch / "model")
    assert (copy / "config.json").read_bytes() == b"{}" and (copy / "sub" / "weights.bin").read_bytes() == b"w"
    one = storage.local_copy(storage.join(tree, "sub", "weights.bin"), scratch / "file")
    assert one.read_bytes() == b"w" and (one == Path(tree) / "sub" / "weights.bin" if local_root else
                                         one == scratch / "file" / "weights.bin")
    missing = storage.local_copy(storage.join(root, "metrics", "rank-0.jsonl"), scratch / "metrics")
    assert not missing.exists() and missing.name == "rank-0.jsonl"  # where to write it, for a later publish
    assert scratch.exists() != local_root  # nothing is copied for a local URL


def test_published_files_land_in_order_and_a_local_target_needs_no_copy(root, tmp_path, monkeypatch):
    url = storage.join(root, "checkpoints")
    local = storage.local_target(url, tmp_path / "scratch")
    assert local == (tmp_path / "scratch" / "checkpoints" if root.startswith("s3://") else Path(url))
    local.mkdir(parents=True, exist_ok=True)
    for name in ("ckpt-1.index", "checkpoint", "other.txt"):
        (local / name).write_bytes(name.encode())
    uploaded: list[str] = []
    upload = storage.upload_file
    monkeypatch.setattr(storage, "upload_file", lambda path, target: (uploaded.append(Path(path).name),
                                                                       upload(path, target)))
    storage.publish_files(local, url, ["ckpt-1.index", "checkpoint"])
    assert uploaded == ([] if local == Path(url) else ["ckpt-1.index", "checkpoint"])  # the index last
    assert storage.read_bytes(storage.join(url, "checkpoint")) == b"checkpoint"
    storage.publish_files(local, url)
    assert storage.read_bytes(storage.join(url, "other.txt")) == b"other.txt"


def test_an_empty_directory_is_removed_and_a_full_one_kept(tmp_path):
    full, empty = tmp_path / "full", tmp_path / "empty"
    (full / "plan").mkdir(parents=True)
    empty.mkdir()
    for directory in (full, empty, tmp_path / "never"):
        storage.remove_empty_directory(str(directory))
    assert full.exists() and not empty.exists()
