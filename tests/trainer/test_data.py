"""The reader side: manifest, per-worker shards, verified staging (local and S3), and the tf.data pipeline."""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import stat
from pathlib import Path

import numpy as np
import pytest

from core import storage
from tasks.dataset.stage import prepare_dataset
from tasks.tfrecord import write_sequence_records
from tests.tasks.dataset.corpus import config, read_tfrecords
from trainer.data import (
    DataError,
    load_manifest,
    make_dataset,
    shard_cache_dir,
    stage_shards,
    token_dtype,
    worker_shards,
)

pytest_plugins = ["tests.support.s3server"]


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    """A dataset prepared once for this module: (manifest URL, manifest)."""
    root = tmp_path_factory.mktemp("data")
    result = prepare_dataset(config(root, num_workers=2))
    return result.manifest_url, load_manifest(result.manifest_url)


@pytest.fixture
def dataset_copy(prepared, tmp_path):
    """A private copy of the prepared dataset, for tests that damage it."""
    source = Path(prepared[0]).parent
    copy = tmp_path / source.name  # a dataset's directory is named by its fingerprint
    shutil.copytree(source, copy)
    return str(copy / "manifest.json"), prepared[1]


def decoded_sequences(manifest_url: str, shards: list[dict], block_size: int) -> np.ndarray:
    directory = Path(manifest_url).parent
    records = [r for shard in shards for r in read_tfrecords((directory / shard["name"]).read_bytes())]
    return np.concatenate([np.frombuffer(r, "<u2") for r in records]).reshape(-1, block_size)


def test_writer_output_is_byte_identical_to_tensorflow(tmp_path):
    import tensorflow as tf

    rows = np.random.default_rng(0).integers(0, 50_000, size=(1000, 24), dtype=np.uint16)
    ours = io.BytesIO()
    assert write_sequence_records(ours, rows, 64) == 16
    with tf.io.TFRecordWriter(str(tmp_path / "reference.tfrecord")) as writer:
        for start in range(0, len(rows), 64):
            writer.write(rows[start:start + 64].astype("<u2").tobytes())
    assert ours.getvalue() == (tmp_path / "reference.tfrecord").read_bytes()


def test_make_dataset_yields_every_sequence_in_order(prepared, tmp_path):
    manifest_url, manifest = prepared
    shards = manifest["splits"]["train"]["shards"]
    files = stage_shards(manifest_url, shards, tmp_path / "staged")
    dataset = make_dataset(files[:1], block_size=32, dtype="uint16", batch_size=1, shuffle=False, seed=0,
                           repeat=False)
    batches = np.concatenate([batch.numpy() for batch in dataset])
    assert batches.dtype == np.int32 and batches.shape == (shards[0]["sequences"], 32)
    np.testing.assert_array_equal(batches, decoded_sequences(manifest_url, shards[:1], 32))


def test_shuffled_batches_are_full_and_seeded(prepared, tmp_path):
    manifest_url, manifest = prepared
    files = stage_shards(manifest_url, manifest["splits"]["train"]["shards"], tmp_path / "staged")

    def first_batches(seed: int) -> np.ndarray:
        dataset = make_dataset(files, block_size=32, dtype="uint16", batch_size=8, shuffle=True, seed=seed,
                               repeat=True)
        return np.stack([batch.numpy() for batch in dataset.take(5)])

    batches = first_batches(1)
    assert batches.shape == (5, 8, 32)
    np.testing.assert_array_equal(batches, first_batches(1))
    assert not np.array_equal(batches, first_batches(2))
    every_sequence = {row.tobytes() for row in decoded_sequences(
        manifest_url, manifest["splits"]["train"]["shards"], 32).astype(np.int32)}
    assert all(row.tobytes() in every_sequence for row in batches.reshape(-1, 32))


def test_uint32_records_decode_to_the_same_ids(tmp_path):
    rows = np.array([[70_000, 1, 2, 3, 4, 5, 6, 7], [8, 9, 10, 11, 12, 13, 14, 2**31 - 1]], dtype=np.uint32)
    with open(tmp_path / "wide.tfrecord", "wb") as handle:
        write_sequence_records(handle, rows, 2)
    dataset = make_dataset([str(tmp_path / "wide.tfrecord")], block_size=8, dtype="uint32", batch_size=2,
                           shuffle=False, seed=0, repeat=False)
    np.testing.assert_array_equal(next(iter(dataset)).numpy(), rows.astype(np.int64))


def test_workers_get_distinct_shards_and_too_few_shards_is_an_error(prepared):
    _, manifest = prepared
    names = [[s["name"] for s in worker_shards(manifest, "train", rank, 3)] for rank in range(3)]
    flat = [name for worker in names for name in worker]
    assert len(flat) == len(set(flat)) == len(manifest["splits"]["train"]["shards"])
    with pytest.raises(DataError, match=r"'validation' has 2 shard\(s\) for 3 workers"):
        worker_shards(manifest, "validation", 0, 3)


def test_truncated_shard_is_detected_before_training(dataset_copy, tmp_path):
    manifest_url, manifest = dataset_copy
    shard = manifest["splits"]["train"]["shards"][1]
    path = Path(manifest_url).parent / shard["name"]
    path.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(DataError, match=rf"Shard .*{shard['name']} is damaged: {shard['bytes'] - 100} bytes"):
        stage_shards(manifest_url, manifest["splits"]["train"]["shards"], tmp_path / "staged")
    assert not list((tmp_path / "staged").glob(f"*{shard['name']}*"))


def test_altered_shard_of_the_same_size_is_detected(dataset_copy, tmp_path):
    manifest_url, manifest = dataset_copy
    shard = manifest["splits"]["validation"]["shards"][0]
    path = Path(manifest_url).parent / shard["name"]
    data = bytearray(path.read_bytes())
    data[100] ^= 0x01
    path.write_bytes(bytes(data))
    with pytest.raises(DataError, match=rf"Shard .*{shard['name']} is damaged: sha256"):
        stage_shards(manifest_url, [shard], tmp_path / "staged")


def test_a_damaged_local_copy_is_fetched_again(prepared, tmp_path):
    manifest_url, manifest = prepared
    shard = manifest["splits"]["train"]["shards"][0]
    [local] = stage_shards(manifest_url, [shard], tmp_path / "staged")
    Path(local).write_bytes(b"garbage")
    assert stage_shards(manifest_url, [shard], tmp_path / "staged") == [local]
    assert storage.sha256_file(local) == shard["sha256"]


def test_stage_from_s3(prepared, s3_bucket, tmp_path):
    manifest_url, manifest = prepared
    remote = f"{s3_bucket}/datasets/{manifest['fingerprint']}"
    fs, path = storage.filesystem(remote)
    local_dir = Path(manifest_url).parent
    files = sorted(p for p in local_dir.rglob("*") if p.is_file())
    fs.put([str(p) for p in files], [f"{path}/{p.relative_to(local_dir).as_posix()}" for p in files])

    remote_manifest = load_manifest(f"{remote}/manifest.json")
    staged = stage_shards(f"{remote}/manifest.json", worker_shards(remote_manifest, "train", 1, 2), tmp_path / "s")
    assert [Path(p).name for p in staged] == [s["name"] for s in manifest["splits"]["train"]["shards"][1::2]]


def test_manifest_problems_are_named(tmp_path):
    with pytest.raises(DataError, match=r"manifest.json does not exist"):
        load_manifest(str(tmp_path / "manifest.json"))
    (tmp_path / "manifest.json").write_text(json.dumps({
        "format_version": 99, "fingerprint": "x", "dtype": "uint16", "block_size": 8, "sequences_per_record": 1,
        "tokenizer": {}, "splits": {},
    }))
    with pytest.raises(DataError, match=r"format_version 99, this trainer reads 1"):
        load_manifest(str(tmp_path / "manifest.json"))


OTHER_UID = 65534  # nobody


def test_shard_cache_is_per_user_and_private(prepared, tmp_path):
    manifest_url, manifest = prepared
    cache = shard_cache_dir(manifest["fingerprint"], base=tmp_path)
    assert cache == tmp_path / f"gpt-finetune-shards-{os.getuid()}" / manifest["fingerprint"]
    for directory in (cache, cache.parent):
        info = directory.lstat()
        assert stat.S_IMODE(info.st_mode) == 0o700 and info.st_uid == os.getuid()
    [local] = stage_shards(manifest_url, manifest["splits"]["train"]["shards"][:1], cache)
    assert Path(local).parent == cache

    cache.chmod(0o755)  # an old cache of this user, opened up: narrowed again
    assert shard_cache_dir(manifest["fingerprint"], base=tmp_path) == cache
    assert stat.S_IMODE(cache.stat().st_mode) == 0o700


@pytest.mark.parametrize("level", ["user", "dataset"])
def test_a_shard_cache_reached_through_a_symlink_is_refused(prepared, tmp_path, level):
    manifest_url, manifest = prepared
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(mode=0o700)
    user_dir = tmp_path / f"gpt-finetune-shards-{os.getuid()}"
    if level == "user":
        user_dir.symlink_to(elsewhere)
    else:
        user_dir.mkdir(mode=0o700)
        (user_dir / manifest["fingerprint"]).symlink_to(elsewhere)
    with pytest.raises(DataError, match="is a symbolic link"):
        shard_cache_dir(manifest["fingerprint"], base=tmp_path)
    with pytest.raises(DataError, match="is a symbolic link"):
        stage_shards(manifest_url, manifest["splits"]["train"]["shards"][:1], user_dir / manifest["fingerprint"]
                     if level == "dataset" else user_dir)
    assert not any(elsewhere.iterdir())


@pytest.mark.skipif(os.getuid() != 0, reason="creating a directory owned by another user needs root")
def test_a_shard_cache_owned_by_someone_else_is_refused(prepared, tmp_path):
    manifest_url, manifest = prepared
    planted = tmp_path / f"gpt-finetune-shards-{os.getuid()}"
    planted.mkdir(mode=0o777)
    os.chown(planted, OTHER_UID, OTHER_UID)
    with pytest.raises(DataError, match=f"belongs to uid {OTHER_UID}, not to this user"):
        shard_cache_dir(manifest["fingerprint"], base=tmp_path)
    with pytest.raises(DataError, match=f"belongs to uid {OTHER_UID}"):
        stage_shards(manifest_url, manifest["splits"]["train"]["shards"][:1], planted)


def _rewritten(dataset_copy, change) -> str:
    """The copied dataset's manifest after `change(manifest)`, as a storage writer could leave it."""
    manifest_url, _ = dataset_copy
    manifest = json.loads(Path(manifest_url).read_text())
    change(manifest)
    Path(manifest_url).write_text(json.dumps(manifest))
    return manifest_url


def _rename_first_shard(name):
    def change(manifest):
        manifest["splits"]["train"]["shards"][0]["name"] = name
    return change


@pytest.mark.parametrize(("change", "named"), [
    (_rename_first_shard("../../escaped.pth"), r"shard name '\.\./\.\./escaped\.pth'"),
    (_rename_first_shard("/tmp/escaped.pth"), r"shard name '/tmp/escaped\.pth'"),
    (_rename_first_shard("train-00000-of-00004.tfrecord/../../x"), r"shard name"),
    (lambda m: m.update(fingerprint="../../victim/x"), r"fingerprint '\.\./\.\./victim/x' is not"),
    (lambda m: m.update(fingerprint="0" * 20), r"fingerprint '0{20}' is not the name of its directory"),
    (lambda m: m["tokenizer"].update(path="../../other"), r"tokenizer path is not 'tokenizer'"),
    (lambda m: m["splits"].update(extra={"shards": []}), r"splits are not among"),
    (lambda m: m["splits"]["train"]["shards"][0].update(bytes="9"), r"has no byte count and sha256"),
], ids=["dot-dot-name", "absolute-name", "name-with-a-path", "dot-dot-fingerprint", "foreign-fingerprint",
        "tokenizer-path", "unknown-split", "string-size"])
def test_a_manifest_whose_names_reach_outside_is_refused_before_any_io(dataset_copy, tmp_path, change, named):
    """Review t4 #1: shard names and the fingerprint become local paths on every worker host."""
    manifest_url = _rewritten(dataset_copy, change)
    with pytest.raises(DataError, match=named):
        load_manifest(manifest_url)
    assert not any(tmp_path.glob("*.pth")) and not (tmp_path / "victim").exists()


def test_staging_never_writes_outside_its_directory(dataset_copy, tmp_path):
    """The review's reproduction, at the staging step itself (a caller that skipped load_manifest): the planted
    object passes its size and sha256 check, yet is refused, and nothing is written beside the cache."""
    manifest_url, _ = dataset_copy
    payload = b"import os; os.system('id')\n"
    (tmp_path / "escaped.pth").write_bytes(payload)
    shard = {"name": "../../escaped.pth", "bytes": len(payload), "sha256": hashlib.sha256(payload).hexdigest()}
    cache = tmp_path / "cache" / "fp"
    with pytest.raises(DataError, match=r"Shard entry refused before staging"):
        stage_shards(manifest_url, [shard], cache)
    assert {p.name for p in tmp_path.iterdir()} == {"cache", Path(manifest_url).parent.name, "escaped.pth"}
    assert not any(cache.iterdir())


@pytest.mark.parametrize("fingerprint", ["../../victim/x", "/etc", "", "ABCDEF0123456789ABCD", 7])
def test_a_fingerprint_that_is_no_dataset_name_gets_no_cache_directory(tmp_path, fingerprint):
    with pytest.raises(DataError, match=r"would not name one directory of the shard cache"):
        shard_cache_dir(fingerprint, base=tmp_path / "hosttmp")
    assert not (tmp_path / "hosttmp").exists()


ODD_VALUES = [None, True, 0, -1, 2 ** 70, 1.5, "", "..", "../../x", "/etc/passwd", "a\nb", [], {}, [{}], {"shards": 1},
              "train-00000-of-00004.tfrecord", "0" * 20, "ab" * 10]


def _odd_manifest(rng, manifest: dict):
    """The genuine manifest with a few values, at any depth, replaced by odd ones; now and then no object at all."""
    if rng.random() < 0.05:
        return rng.choice(ODD_VALUES)
    manifest = json.loads(json.dumps(manifest))
    for _ in range(rng.randint(1, 3)):
        target = manifest
        while True:
            keys = list(target) if isinstance(target, dict) else list(range(len(target))) if isinstance(
                target, list) else []
            if not keys:
                break
            key = rng.choice(keys)
            if rng.random() < 0.4 or not isinstance(target[key], (dict, list)):
                target[key] = rng.choice(ODD_VALUES)
                break
            target = target[key]
    return manifest


def test_generated_manifests_are_loaded_and_staged_or_refused_with_data_error(dataset_copy, tmp_path):
    """Fuzz (issue 37): any manifest a storage writer leaves either loads and stages inside the cache directory, or
    raises DataError; nothing is written outside the cache, and it takes milliseconds each."""
    import random
    import time

    manifest_url, genuine = dataset_copy
    rng = random.Random(37)
    cache = tmp_path / "cache" / "fp"
    before = {p for p in tmp_path.rglob("*") if "cache" not in p.parts}
    started = time.perf_counter()
    outcomes = {"staged": 0, "refused": 0}
    for case in range(150):
        data = _odd_manifest(rng, genuine)
        Path(manifest_url).write_text(json.dumps(data) if rng.random() < 0.95 else "[" * 10000)
        try:
            manifest = load_manifest(manifest_url)
            shards = [shard for split in manifest["splits"].values() for shard in split["shards"]]
            staged = stage_shards(manifest_url, shards, cache)
            assert all(Path(path).parent == cache for path in staged), case
            outcomes["staged"] += 1
        except DataError:
            outcomes["refused"] += 1
    assert {p for p in tmp_path.rglob("*") if "cache" not in p.parts} == before
    assert outcomes["refused"] > 50 and time.perf_counter() - started < 60, outcomes


def test_token_ids_take_two_bytes_while_every_id_fits():
    assert token_dtype(1 << 16) == "uint16"  # ids 0..65535
    assert token_dtype((1 << 16) + 1) == "uint32"


def test_a_shard_rewritten_with_its_manifest_entry_is_refused_by_the_pinned_manifest(prepared, tmp_path):
    """Review t5, finding 11: the manifest carries the shards' sha256 itself, so a writer who rewrote a shard and its
    entry passed load_manifest and staging. Pinned by the digest the Airflow side read, the manifest is refused."""
    from core.protocol import MANIFEST_SHA256_ENV
    from trainer.data import read_manifest

    dataset = Path(prepared[0]).parent
    url = str(shutil.copytree(dataset, tmp_path / dataset.name) / "manifest.json")
    manifest, pinned = read_manifest(url)
    assert pinned == hashlib.sha256(Path(url).read_bytes()).hexdigest()
    assert load_manifest(url, {MANIFEST_SHA256_ENV: pinned}) == manifest
    shard = manifest["splits"]["train"]["shards"][0]
    poisoned = Path(url).parent / shard["name"]
    poisoned.write_bytes(poisoned.read_bytes()[::-1])
    shard["sha256"] = hashlib.sha256(poisoned.read_bytes()).hexdigest()
    Path(url).write_text(json.dumps(manifest))
    assert load_manifest(url, {})["splits"]["train"]["shards"][0]["sha256"] == shard["sha256"]  # unpinned: passes
    with pytest.raises(DataError) as refused:
        load_manifest(url, {MANIFEST_SHA256_ENV: pinned})
    message = str(refused.value)
    assert f"Manifest {url} has sha256 {read_manifest(url)[1]}, but the Airflow side pinned {pinned} " in message
    assert "(TFMW_MANIFEST_SHA256)" in message and "Refusing it" in message
    with pytest.raises(DataError, match=r"pinned \(empty\)"):
        load_manifest(url, {MANIFEST_SHA256_ENV: ""})
