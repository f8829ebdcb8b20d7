"""The prepare stage end to end on real files, a real S3-protocol server and real processes.

Shards are read back here with a small TFRecord reader of the test's own (with its own CRC-32C), so these tests
check the file format independently of the writer and without importing TensorFlow.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from tasks.tokenize import (
    PrepareError,
    check_block_size,
    identify_dataset,
    plan_tokenizer,
    prepare_dataset,
    train_bpe,
    validation_mask,
)
from trainer import storage
from trainer.config import RunConfig

pytest_plugins = ["tests.s3server"]

REPO = Path(__file__).resolve().parents[2]
SAMPLE = REPO / "data" / "sample"


# ---------------------------------------------------------------------------------------------------------------
# helpers


def _crc32c(data: bytes) -> int:
    crc = 0xFFFFFFFF
    for byte in data:
        crc = _CRC_TABLE[(crc ^ byte) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


def _make_table() -> list[int]:
    table = []
    for value in range(256):
        for _ in range(8):
            value = (value >> 1) ^ 0x82F63B78 if value & 1 else value >> 1
        table.append(value)
    return table


_CRC_TABLE = _make_table()


def _masked(crc: int) -> int:
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def read_tfrecords(data: bytes) -> list[bytes]:
    """Parse TFRecord framing, checking both CRCs of every record."""
    records, offset = [], 0
    while offset < len(data):
        header = data[offset:offset + 8]
        (length,) = np.frombuffer(header, "<u8")
        assert int(np.frombuffer(data[offset + 8:offset + 12], "<u4")[0]) == _masked(_crc32c(header))
        payload = data[offset + 12:offset + 12 + int(length)]
        footer = data[offset + 12 + int(length):offset + 16 + int(length)]
        assert int(np.frombuffer(footer, "<u4")[0]) == _masked(_crc32c(payload))
        records.append(payload)
        offset += 16 + int(length)
    assert offset == len(data)
    return records


def config(tmp_path: Path, **overrides) -> RunConfig:
    settings = {"dataset": str(SAMPLE / "*.txt"), "tokenizer": "bpe:512", "block_size": 32, "num_workers": 2,
                "storage_root": str(tmp_path / "storage")}
    return RunConfig(**(settings | overrides))


def sample_documents() -> list[str]:
    """Documents as the stage defines them for .txt: blank-line separated paragraphs, file by file."""
    documents = []
    for path in sorted(SAMPLE.glob("*.txt")):
        documents += [part for part in path.read_text(encoding="utf-8").split("\n\n") if part]
    return documents


def dataset_names(manifest_url: str) -> list[str]:
    directory = manifest_url.rsplit("/", 1)[0]
    fs, path = storage.filesystem(directory)
    return [os.path.relpath(name, path) for name in fs.find(path)]


def dataset_files(manifest_url: str) -> dict[str, bytes]:
    directory = manifest_url.rsplit("/", 1)[0]
    fs, path = storage.filesystem(directory)
    return {os.path.relpath(name, path): fs.cat_file(name) for name in fs.find(path)}


def comparable(manifest: dict) -> dict:
    """The manifest without what must differ between runs on other storage: URLs, times, fingerprint."""
    stripped = json.loads(json.dumps(manifest))
    for key in ("created_at", "fingerprint"):
        stripped.pop(key)
    stripped["sources"] = [{"size": source["size"]} for source in stripped["sources"]]
    return stripped


def write_corpus(directory: Path, files: int = 2, paragraphs: int = 60) -> Path:
    words = ["the", "of", "and", "to", "in", "that", "is", "was", "he", "for", "it", "with", "as", "his", "on", "be",
             "at", "by", "I", "had", "not", "are", "but", "from", "or", "have"]
    rng = np.random.default_rng(7)
    directory.mkdir(parents=True, exist_ok=True)
    for index in range(files):
        text = "\n\n".join(" ".join(rng.choice(words, size=rng.integers(5, 40))) for _ in range(paragraphs))
        (directory / f"part-{index}.txt").write_text(text + "\n", encoding="utf-8")
    return directory


# ---------------------------------------------------------------------------------------------------------------
# exactness, cache, determinism


def test_shards_reproduce_the_packed_token_stream(tmp_path, caplog):
    from transformers import AutoTokenizer

    cfg = config(tmp_path)
    with caplog.at_level(logging.INFO, logger="gpt_finetune.prepare"):
        result = prepare_dataset(cfg, progress_interval_s=0.0)
    assert not result.cache_hit
    messages = [record.getMessage() for record in caplog.records]
    assert any("tokens/s, ETA" in message for message in messages)
    # The figure users see: the rate over the whole stage, its start-up included, with the cores it had.
    summary = next(message for message in messages if message.startswith("prepare: "))
    assert f"tokens/s end to end on {len(os.sched_getaffinity(0))} core(s): start-up " in summary, summary

    manifest = storage.read_json(result.manifest_url)
    files = dataset_files(result.manifest_url)
    assert manifest["fingerprint"] == result.fingerprint
    assert manifest["dtype"] == "uint16" and manifest["block_size"] == 32
    assert len(manifest["splits"]["train"]["shards"]) == cfg.effective_num_shards == 8

    tokenizer = AutoTokenizer.from_pretrained(str(Path(result.manifest_url).parent / "tokenizer"))
    assert tokenizer.eos_token_id == manifest["tokenizer"]["eos_token_id"]
    assert {f["name"] for f in manifest["tokenizer"]["files"]} >= {"tokenizer.json", "tokenizer_config.json"}
    documents = sample_documents()
    held_out = validation_mask(len(documents), cfg.val_fraction, cfg.seed)
    ids = tokenizer(documents, add_special_tokens=False)["input_ids"]

    for split, wanted in (("train", False), ("validation", True)):
        stream = np.array(
            [t for doc, is_val in zip(ids, held_out) if is_val == wanted for t in doc + [tokenizer.eos_token_id]]
        )
        entry = manifest["splits"][split]
        shards = entry["shards"]
        decoded = []
        for shard in shards:
            data = files[shard["name"]]
            assert len(data) == shard["bytes"]
            assert hashlib.sha256(data).hexdigest() == shard["sha256"]
            records = read_tfrecords(data)
            assert len(records) == shard["records"]
            tokens = np.concatenate([np.frombuffer(r, "<u2") for r in records])
            assert all(len(r) % (2 * 32) == 0 for r in records)
            assert tokens.size == shard["tokens"] == shard["sequences"] * 32
            decoded.append(tokens)
        packed = np.concatenate(decoded)
        assert entry["sequences"] == len(stream) // 32 == sum(s["sequences"] for s in shards)
        np.testing.assert_array_equal(packed, stream[: entry["sequences"] * 32])
        counts = [s["sequences"] for s in shards]
        assert max(counts) - min(counts) <= 1
        assert entry["documents"] == int(held_out.sum() if wanted else (~held_out).sum())

    first_train = next(doc for doc, is_val in zip(documents, held_out) if not is_val)
    train_tokens = np.concatenate([np.frombuffer(r, "<u2") for s in manifest["splits"]["train"]["shards"]
                                   for r in read_tfrecords(files[s["name"]])])
    first_eos = int(np.argmax(train_tokens == tokenizer.eos_token_id))
    assert tokenizer.decode(train_tokens[:first_eos].tolist()) == first_train

    shard_bytes = sum(s["bytes"] for split in manifest["splits"].values() for s in split["shards"])
    shard_tokens = sum(split["tokens"] for split in manifest["splits"].values())
    assert shard_bytes / shard_tokens <= 2.1


def test_second_run_is_a_cache_hit_and_a_damaged_cache_is_rebuilt(tmp_path, caplog):
    cfg = config(tmp_path, dataset=str(write_corpus(tmp_path / "corpus")), num_workers=1, block_size=16)
    first = prepare_dataset(cfg)
    with caplog.at_level(logging.INFO, logger="gpt_finetune.prepare"):
        second = prepare_dataset(cfg)
    assert second.cache_hit and second.fingerprint == first.fingerprint
    assert second.tokenized_tokens == 0
    assert any("cache hit" in record.getMessage() for record in caplog.records)

    shard = storage.read_json(first.manifest_url)["splits"]["train"]["shards"][0]["name"]
    (Path(first.manifest_url).parent / shard).unlink()
    third = prepare_dataset(cfg)
    assert not third.cache_hit
    assert (Path(first.manifest_url).parent / shard).exists()


@pytest.mark.parametrize(
    "change",
    [
        {"tokenizer": "bpe:600"},
        {"block_size": 64},
        {"val_fraction": 0.1},
        {"seed": 99},
        {"num_shards": 3},
        {"text_column": "body"},
        "touch-source",
        "grow-source",
    ],
)
def test_every_input_changes_the_fingerprint(tmp_path, change):
    corpus = write_corpus(tmp_path / "corpus")
    cfg = config(tmp_path, dataset=str(corpus), num_workers=1)
    before = identify_dataset(cfg).fingerprint
    assert identify_dataset(cfg).fingerprint == before
    source = corpus / "part-0.txt"
    if change == "touch-source":
        os.utime(source, (time.time() + 10, time.time() + 10))
    elif change == "grow-source":
        os.utime(source, (source.stat().st_atime,) * 2)
        source.write_text(source.read_text() + "more\n")
    else:
        cfg = cfg.replace(**change)
    assert identify_dataset(cfg).fingerprint != before


PREPARE_ON_CORES = """
import json, logging, os, sys
os.sched_setaffinity(0, json.loads(sys.argv[1]))  # before any thread pool exists: every thread inherits it
logging.basicConfig(level=logging.INFO, format="%(message)s")
from trainer.config import RunConfig
from tasks.tokenize import prepare_dataset
result = prepare_dataset(RunConfig.from_params(json.loads(sys.argv[2])))
threads = [len(os.sched_getaffinity(int(tid))) for tid in os.listdir("/proc/self/task")]
print(json.dumps({"fingerprint": result.fingerprint, "manifest_url": result.manifest_url, "thread_cores": threads}))
"""


def prepare_on_cores(cfg: RunConfig, cores: set[int]) -> dict:
    """prepare_dataset in a fresh process confined to `cores` from its start, as a task on a smaller machine runs.

    Returns its result, the cores each of its threads (the tokenizer's pool included) may run on, and the cores the
    stage says it tokenized on."""
    done = subprocess.run([sys.executable, "-c", PREPARE_ON_CORES, json.dumps(sorted(cores)), cfg.to_json()],
                          cwd=REPO, capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    logged = [line for line in done.stderr.splitlines() if line.startswith("tokenizing ")]
    assert len(logged) == 1, done.stderr[-3000:]
    result["tokenized_on"] = int(logged[0].rsplit(" on ", 1)[1].split()[0])
    return result


def test_output_does_not_depend_on_the_number_of_cores(tmp_path):
    cores = os.sched_getaffinity(0)
    if len(cores) < 2:
        pytest.skip(f"needs at least 2 cores to compare with 1; this process may use {len(cores)}")
    cfg = config(tmp_path, num_workers=1, block_size=64)
    many = prepare_on_cores(cfg.replace(storage_root=str(tmp_path / "many")), cores)
    one = prepare_on_cores(cfg.replace(storage_root=str(tmp_path / "one")), {min(cores)})

    # The parallelism each run really had: every thread of the one-core run confined to one core, the other's free
    # to use all, with thread pools (the tokenizer's among them) sized to match.
    assert (one["tokenized_on"], set(one["thread_cores"])) == (1, {1})
    assert (many["tokenized_on"], set(many["thread_cores"])) == (len(cores), {len(cores)})
    assert len(many["thread_cores"]) > len(one["thread_cores"])

    assert one["fingerprint"] == many["fingerprint"]
    one_files, many_files = dataset_files(one["manifest_url"]), dataset_files(many["manifest_url"])
    assert one_files.keys() == many_files.keys()
    for name, data in one_files.items():
        if name != "manifest.json":
            assert data == many_files[name], name
    assert comparable(storage.read_json(one["manifest_url"])) == comparable(storage.read_json(many["manifest_url"]))


def test_local_and_s3_give_the_same_shards_and_manifest(tmp_path, s3_bucket):
    for path in sorted(SAMPLE.glob("*.txt")):
        storage.upload_file(path, f"{s3_bucket}/corpus/{path.name}")
    local = prepare_dataset(config(tmp_path))
    remote = prepare_dataset(config(tmp_path, dataset=f"{s3_bucket}/corpus/*.txt", storage_root=f"{s3_bucket}/store"))

    assert remote.manifest_url.startswith(f"{s3_bucket}/store/datasets/")
    local_files, remote_files = dataset_files(local.manifest_url), dataset_files(remote.manifest_url)
    assert local_files.keys() == remote_files.keys()
    for name in local_files:
        if name != "manifest.json":
            assert local_files[name] == remote_files[name], name
    local_manifest = storage.read_json(local.manifest_url)
    remote_manifest = storage.read_json(remote.manifest_url)
    assert comparable(local_manifest) == comparable(remote_manifest)
    assert [s["url"] for s in remote_manifest["sources"]] == [f"{s3_bucket}/corpus/{p.name}"
                                                              for p in sorted(SAMPLE.glob("*.txt"))]
    assert prepare_dataset(config(tmp_path, dataset=f"{s3_bucket}/corpus/*.txt",
                                  storage_root=f"{s3_bucket}/store")).cache_hit


def test_structured_sources_use_the_text_column(tmp_path):
    corpus = tmp_path / "jsonl"
    corpus.mkdir()
    rows = [{"id": i, "body": f"document number {i} " + "words " * (i % 17)} for i in range(300)]
    (corpus / "data.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n", encoding="utf-8")
    result = prepare_dataset(config(tmp_path, dataset=str(corpus / "data.jsonl"), text_column="body",
                                    num_workers=1, num_shards=2, block_size=16))
    manifest = storage.read_json(result.manifest_url)
    assert manifest["splits"]["train"]["documents"] + manifest["splits"]["validation"]["documents"] == 300
    assert manifest["settings"]["text_column"] == "body"


def shard_tokens(manifest_url: str, split: str) -> np.ndarray:
    files = dataset_files(manifest_url)
    shards = storage.read_json(manifest_url)["splits"][split]["shards"]
    return np.concatenate([np.frombuffer(r, "<u2") for s in shards for r in read_tfrecords(files[s["name"]])])


def test_documents_are_joined_at_the_eos_only_where_that_keeps_the_ids(tmp_path, caplog):
    """The stage encodes runs of documents joined by the EOS text when that gives the same ids. A tokenizer that
    treats only the start of its input specially (Metaspace, prepend_scheme "first") must get one document per
    input instead, and the same ids as tokenizing each document alone."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    documents = sample_documents()
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
    backend.decoder = decoders.Metaspace(prepend_scheme="first")
    backend.train_from_iterator(documents, trainers.BpeTrainer(vocab_size=400, special_tokens=["</s>"],
                                                               show_progress=False))
    eos = backend.token_to_id("</s>")
    separately = [t for ids in backend.encode_batch(documents[:3]) for t in (*ids.ids, eos)]
    assert backend.encode("</s>".join(documents[:3]) + "</s>").ids != separately  # joining would change the ids
    PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="</s>").save_pretrained(str(tmp_path / "metaspace"))

    for tokenizer, joined in ((str(tmp_path / "metaspace"), False), ("bpe:512", True)):
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="gpt_finetune.prepare"):
            result = prepare_dataset(config(tmp_path, tokenizer=tokenizer, num_workers=1))
        reference = AutoTokenizer.from_pretrained(str(Path(result.manifest_url).parent / "tokenizer"))
        cfg = config(tmp_path, tokenizer=tokenizer, num_workers=1)
        held_out = validation_mask(len(documents), cfg.val_fraction, cfg.seed)
        ids = reference(documents, add_special_tokens=False)["input_ids"]
        for split, wanted in (("train", False), ("validation", True)):
            stream = [t for doc, is_val in zip(ids, held_out) if is_val == wanted
                      for t in (*doc, reference.eos_token_id)]
            packed = shard_tokens(result.manifest_url, split)
            assert 0 < len(packed) <= len(stream)
            np.testing.assert_array_equal(packed, stream[:len(packed)])
        logged = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("tokenizing "))
        assert ("one document per tokenizer input" in logged) is not joined, logged


def test_text_files_give_the_paragraphs_of_datasets_text_builder(tmp_path):
    """Plain text is read without `datasets` now; its documents must stay those of `sample_by="paragraph"`."""
    import datasets

    from tasks.sources import load_documents, resolve_sources

    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.txt").write_bytes(b"\n\nfirst paragraph\nsecond line\n\n\n\nafter three blank lines\n\n")
    (corpus / "b.txt").write_bytes(b"windows\r\nlines\r\n\r\nold mac\rline\r\rend without newline")
    (corpus / "c.txt").write_bytes(b"")
    sources = resolve_sources(str(corpus / "*.txt"), REPO)
    reference = datasets.load_dataset("text", data_files=[f.url for f in sources.files], sample_by="paragraph",
                                      split="train", cache_dir=str(tmp_path / "hf"))["text"]
    assert load_documents(sources, "text", tmp_path / "work") == reference
    assert len(reference) == 5


def test_a_pretrained_tokenizer_directory_is_used_as_is(tmp_path):
    from transformers import AutoTokenizer

    first = prepare_dataset(config(tmp_path, num_workers=1))
    tokenizer_dir = Path(first.manifest_url).parent / "tokenizer"
    second = prepare_dataset(config(tmp_path, num_workers=1, tokenizer=str(tokenizer_dir)))
    assert second.fingerprint != first.fingerprint
    assert dataset_files(second.manifest_url)["train-00000-of-00004.tfrecord"] == \
        dataset_files(first.manifest_url)["train-00000-of-00004.tfrecord"]
    assert AutoTokenizer.from_pretrained(str(Path(second.manifest_url).parent / "tokenizer")).vocab_size == 512


def test_tokenizer_and_model_config_from_object_storage(tmp_path, s3_bucket):
    documents = sample_documents()[:400]
    train_bpe(documents, np.zeros(len(documents), dtype=bool), 300).save_pretrained(str(tmp_path / "tok"))
    for path in (tmp_path / "tok").iterdir():
        storage.upload_file(path, f"{s3_bucket}/tok/{path.name}")
    local = plan_tokenizer(config(tmp_path, tokenizer=str(tmp_path / "tok")))
    remote = plan_tokenizer(config(tmp_path, tokenizer=f"{s3_bucket}/tok"))
    assert remote.fingerprint == local.fingerprint and remote.dtype == "uint16"

    storage.write_json_atomic(f"{s3_bucket}/model/config.json", {"model_type": "gpt2", "n_positions": 16})
    with pytest.raises(PrepareError, match=r"'block_size' = 32 exceeds what model 's3://.*/model' allows"):
        check_block_size(config(tmp_path, model=f"{s3_bucket}/model"))


# ---------------------------------------------------------------------------------------------------------------
# bad input: a clear error naming the file or setting, nothing published


def assert_nothing_published(cfg: RunConfig) -> None:
    assert not list((Path(cfg.storage_root) / "datasets").glob("*/manifest.json"))


def test_missing_source_is_named(tmp_path):
    cfg = config(tmp_path, dataset=str(tmp_path / "nowhere" / "*.txt"))
    with pytest.raises(PrepareError, match=r"matches no .*file"):
        prepare_dataset(cfg)
    with pytest.raises(PrepareError, match=r"nowhere/book.txt does not exist"):
        prepare_dataset(cfg.replace(dataset=str(tmp_path / "nowhere" / "book.txt")))
    assert not (tmp_path / "storage").exists()


def test_hub_dataset_id_while_offline_is_a_clear_error(tmp_path):
    with pytest.raises(PrepareError, match=r"looks like a hub dataset id but the hub is offline"):
        prepare_dataset(config(tmp_path, dataset="someone/some-corpus"))


def test_file_urls_resolve_like_paths(tmp_path):
    by_url = identify_dataset(config(tmp_path, dataset=f"file://{SAMPLE}/*.txt")).sources.files
    assert by_url == identify_dataset(config(tmp_path)).sources.files
    assert [Path(f.url).name for f in by_url] == sorted(p.name for p in SAMPLE.glob("*.txt"))


def test_empty_dataset_is_refused(tmp_path):
    (tmp_path / "empty.txt").write_text("", encoding="utf-8")
    cfg = config(tmp_path, dataset=str(tmp_path / "empty.txt"))
    with pytest.raises(PrepareError, match=r"has no documents: .*empty.txt"):
        prepare_dataset(cfg)
    assert_nothing_published(cfg)


def test_missing_text_column_names_the_columns(tmp_path):
    (tmp_path / "rows.jsonl").write_text('{"body": "a"}\n{"body": "b"}\n', encoding="utf-8")
    cfg = config(tmp_path, dataset=str(tmp_path / "rows.jsonl"), text_column="content")
    with pytest.raises(PrepareError, match=r"'text_column' = 'content' is not a column .*\['body'\]"):
        prepare_dataset(cfg)
    assert_nothing_published(cfg)


def test_non_utf8_bytes_name_the_file_and_offset(tmp_path):
    corpus = write_corpus(tmp_path / "corpus")
    (corpus / "part-9.txt").write_bytes(b"fine text\n\ncaf\xe9 au lait\n")
    cfg = config(tmp_path, dataset=str(corpus / "*.txt"))
    with pytest.raises(PrepareError, match=r"part-9.txt is not valid UTF-8: byte 0xe9 at offset 14"):
        prepare_dataset(cfg)
    assert_nothing_published(cfg)


def test_block_size_beyond_the_model_positions_is_refused(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_positions": 16}), encoding="utf-8")
    cfg = config(tmp_path, model=str(model), block_size=32)
    with pytest.raises(PrepareError, match=r"'block_size' = 32 exceeds what model .* allows \(16 positions\)"):
        prepare_dataset(cfg)
    assert not (tmp_path / "storage").exists()


def test_unwritable_storage_root_fails_before_tokenizing(tmp_path, caplog):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    cfg = config(tmp_path, storage_root=str(blocker / "storage"))
    with caplog.at_level(logging.INFO, logger="gpt_finetune.prepare"), \
            pytest.raises(PrepareError, match=r"'storage_root' = .*a-file/storage' cannot be written"):
        prepare_dataset(cfg)
    messages = [record.getMessage() for record in caplog.records]
    assert messages and messages[0].startswith("dataset ")  # the stage's log is captured: its absence below counts
    assert not any(m.startswith(("loaded", "training a byte-level BPE", "tokenizing")) for m in messages), messages


def test_missing_bucket_is_an_unwritable_storage_root(tmp_path, s3_env):
    with pytest.raises(PrepareError, match=r"'storage_root' = 's3://no-such-bucket/x' cannot be written"):
        prepare_dataset(config(tmp_path, storage_root="s3://no-such-bucket/x"))


# ---------------------------------------------------------------------------------------------------------------
# interrupted writes


def start_prepare_process(cfg: RunConfig, log_path: Path) -> subprocess.Popen:
    code = (
        "import json, logging, sys\n"
        "logging.basicConfig(level=logging.INFO)\n"
        "from trainer.config import RunConfig\n"
        "from tasks.tokenize import prepare_dataset\n"
        "prepare_dataset(RunConfig.from_params(json.loads(sys.argv[1])))\n"
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


def test_killed_local_run_leaves_no_manifest_and_the_next_run_starts_clean(tmp_path):
    cfg = config(tmp_path)
    datasets_dir = Path(cfg.storage_root) / "datasets"
    process = start_prepare_process(cfg, tmp_path / "prepare.log")
    try:
        wait_for(lambda: list(datasets_dir.glob(".*.partial-*/tokenizer/tokenizer.json")), process,
                 tmp_path / "prepare.log")
    finally:
        process.send_signal(signal.SIGKILL)
        process.wait()
    assert list(datasets_dir.glob(".*.partial-*"))
    assert not list(datasets_dir.glob("*/manifest.json"))

    result = prepare_dataset(cfg)
    assert not result.cache_hit
    assert not list(datasets_dir.glob(".*.partial-*"))
    assert [p.name for p in datasets_dir.iterdir() if not p.name.startswith(".write-probe")] == [result.fingerprint]


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


# ---------------------------------------------------------------------------------------------------------------
# the CRC-32C used for TFRecord framing


def test_record_checksums_match_the_reference_crc32c_at_every_length():
    import google_crc32c

    from tasks.tfrecord import masked_crc32c

    # The C extension: the library's pure-Python fallback would make shard writing slower than tokenizing.
    assert google_crc32c.implementation == "c"
    assert google_crc32c.value(b"123456789") == 0xE3069283  # the CRC-32C check value
    rng = np.random.default_rng(3)
    for length in (0, 1, 4, 63, 64, 65, 1000, 8193, 65_536):
        data = rng.integers(0, 256, size=length, dtype=np.uint8)
        assert masked_crc32c(data) == masked_crc32c(data.tobytes()) == _masked(_crc32c(data.tobytes())), length
