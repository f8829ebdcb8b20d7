"""The prepare stage end to end on real files, a real S3-protocol server and real processes: exact shards, the
cache, the fingerprint, the same output for any number of cores, and bad input refused with nothing published.

Shards are read back with the tests' own TFRecord reader (tests/tasks/dataset/corpus.py), and the documents and
draws they must hold are computed without the stage's readers.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from core import storage
from core.config import ConfigError, RunConfig
from tasks.dataset.errors import PrepareError
from tasks.dataset.stage import identify_dataset, prepare_dataset
from tasks.dataset.tokenizer import check_model, plan_tokenizer
from tests.tasks.dataset.corpus import (
    REPO,
    SAMPLE,
    comparable,
    config,
    dataset_files,
    held_out,
    masked,
    read_tfrecords,
    reference_crc32c,
    sample_documents,
    shard_files,
    shard_tokens,
    write_corpus,
)

pytest_plugins = ["tests.support.s3server"]


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
    assert set(result.timings) == {"plan", "units", "shards", "manifest"}

    manifest = storage.read_json(result.manifest_url)
    files = dataset_files(result.manifest_url)
    assert manifest["fingerprint"] == result.fingerprint
    assert manifest["dtype"] == "uint16" and manifest["block_size"] == 32
    assert manifest["settings"]["split_rule"] == "blake2b-file-key+splitmix64-position/v2"
    assert len(manifest["splits"]["train"]["shards"]) == cfg.effective_num_shards == 8

    tokenizer = AutoTokenizer.from_pretrained(str(Path(result.manifest_url).parent / "tokenizer"))
    assert tokenizer.eos_token_id == manifest["tokenizer"]["eos_token_id"]
    assert {f["name"] for f in manifest["tokenizer"]["files"]} >= {"tokenizer.json", "tokenizer_config.json"}
    documents = sample_documents()
    mask = held_out(documents, cfg)
    ids = tokenizer([text for _, _, text in documents], add_special_tokens=False)["input_ids"]

    for split, wanted in (("train", False), ("validation", True)):
        stream = np.array([t for doc, is_val in zip(ids, mask) if is_val == wanted
                           for t in doc + [tokenizer.eos_token_id]])
        entry = manifest["splits"][split]
        decoded = []
        for shard in entry["shards"]:
            data = files[shard["name"]]
            assert len(data) == shard["bytes"] and hashlib.sha256(data).hexdigest() == shard["sha256"]
            records = read_tfrecords(data)
            assert len(records) == shard["records"]
            tokens = np.concatenate([np.frombuffer(r, "<u2") for r in records])
            assert all(len(r) % (2 * 32) == 0 for r in records)
            assert tokens.size == shard["tokens"] == shard["sequences"] * 32
            decoded.append(tokens)
        packed = np.concatenate(decoded)
        assert entry["sequences"] == len(stream) // 32 == sum(s["sequences"] for s in entry["shards"])
        np.testing.assert_array_equal(packed, stream[: entry["sequences"] * 32])
        counts = [s["sequences"] for s in entry["shards"]]
        assert max(counts) - min(counts) <= 1
        assert entry["documents"] == sum(1 for is_val in mask if is_val == wanted)

    shard_bytes = sum(s["bytes"] for split in manifest["splits"].values() for s in split["shards"])
    shard_tokens_count = sum(split["tokens"] for split in manifest["splits"].values())
    assert shard_bytes / shard_tokens_count <= 2.1


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


@pytest.mark.parametrize("change, field", [
    (lambda manifest: manifest.update(block_size="16"), r"Manifest\.block_size: expected int, got str '16'"),
    (lambda manifest: manifest["splits"]["train"]["shards"][0].update(records=None),
     r"Manifest\.splits\.train: SplitEntry\.shards\[0\]: ShardEntry\.records"),
    (lambda manifest: manifest["settings"].pop("seed"), r"Manifest\.settings: PackingSettings: missing key\(s\) seed"),
    (lambda manifest: manifest["splits"].pop("validation"), r"Manifest\.splits: expected the splits"),
])
def test_a_cached_manifest_of_another_shape_is_refused_naming_it_and_the_field(tmp_path, caplog, change, field):
    """Storage is untrusted input: a manifest of this fingerprint that is no `Manifest` is not reused (the dataset
    is prepared again, replacing it); the warning names the file and the field."""
    cfg = config(tmp_path, dataset=str(write_corpus(tmp_path / "corpus")), num_workers=1, block_size=16)
    first = prepare_dataset(cfg)
    path = Path(first.manifest_url)
    manifest = json.loads(path.read_text())
    change(manifest)
    path.write_text(json.dumps(manifest))
    with caplog.at_level(logging.WARNING, logger="gpt_finetune.prepare"):
        again = prepare_dataset(cfg)
    assert not again.cache_hit and again.train_sequences == first.train_sequences
    refusal = rf"{re.escape(str(path))} is refused \({field}"
    assert any(re.search(refusal, record.getMessage()) for record in caplog.records)
    assert prepare_dataset(cfg).cache_hit  # the manifest published again reads back


@pytest.mark.parametrize(
    "change",
    [
        {"tokenizer": "bpe:600"},
        {"block_size": 64},
        {"val_fraction": 0.1},
        {"seed": 99},
        {"num_shards": 3},
        {"text_column": "body"},
        {"bpe_sample_mb": 64},
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


def test_fan_out_and_unit_size_stay_out_of_the_fingerprint(tmp_path):
    cfg = config(tmp_path, dataset=str(write_corpus(tmp_path / "corpus")), num_workers=1)
    assert identify_dataset(cfg).fingerprint == identify_dataset(cfg.replace(prepare_tasks=7,
                                                                             prepare_unit_mb=3)).fingerprint


PREPARE_ON_CORES = """
import json, logging, os, sys
os.sched_setaffinity(0, json.loads(sys.argv[1]))  # before any thread pool exists: every thread inherits it
logging.basicConfig(level=logging.INFO, format="%(message)s")
from core.config import RunConfig
from tasks.dataset.stage import prepare_dataset
result = prepare_dataset(RunConfig.from_saved(json.loads(sys.argv[2])))
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
    assert shard_files(one["manifest_url"]) == shard_files(many["manifest_url"])
    assert comparable(storage.read_json(one["manifest_url"])) == comparable(storage.read_json(many["manifest_url"]))


def test_local_and_s3_give_the_same_shards_and_manifest(tmp_path, s3_bucket):
    for path in sorted(SAMPLE.glob("*.txt")):
        storage.upload_file(path, f"{s3_bucket}/corpus/{path.name}")
    local = prepare_dataset(config(tmp_path))
    remote = prepare_dataset(config(tmp_path, dataset=f"{s3_bucket}/corpus/*.txt", storage_root=f"{s3_bucket}/store"))

    assert remote.manifest_url.startswith(f"{s3_bucket}/store/datasets/")
    assert shard_files(local.manifest_url) == shard_files(remote.manifest_url)
    remote_manifest = storage.read_json(remote.manifest_url)
    assert comparable(storage.read_json(local.manifest_url)) == comparable(remote_manifest)
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


def test_documents_are_joined_at_the_eos_only_where_that_keeps_the_ids(tmp_path, caplog):
    """The stage encodes runs of documents joined by the EOS text when that gives the same ids. A tokenizer that
    treats only the start of its input specially (Metaspace, prepend_scheme "first") must get one document per
    input instead, and the same ids as tokenizing each document alone."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    documents = sample_documents()
    texts = [text for _, _, text in documents]
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
    backend.decoder = decoders.Metaspace(prepend_scheme="first")
    backend.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=400, special_tokens=["</s>"],
                                                           show_progress=False))
    eos = backend.token_to_id("</s>")
    separately = [t for ids in backend.encode_batch(texts[:3]) for t in (*ids.ids, eos)]
    assert backend.encode("</s>".join(texts[:3]) + "</s>").ids != separately  # joining would change the ids
    PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="</s>").save_pretrained(str(tmp_path / "metaspace"))

    for tokenizer, joined in ((str(tmp_path / "metaspace"), False), ("bpe:512", True)):
        caplog.clear()
        cfg = config(tmp_path, tokenizer=tokenizer, num_workers=1)
        with caplog.at_level(logging.INFO, logger="gpt_finetune.prepare"):
            result = prepare_dataset(cfg)
        reference = AutoTokenizer.from_pretrained(str(Path(result.manifest_url).parent / "tokenizer"))
        mask = held_out(documents, cfg)
        ids = reference(texts, add_special_tokens=False)["input_ids"]
        for split, wanted in (("train", False), ("validation", True)):
            stream = [t for doc, is_val in zip(ids, mask) if is_val == wanted for t in (*doc, reference.eos_token_id)]
            packed = shard_tokens(result.manifest_url, split)
            assert 0 < len(packed) <= len(stream)
            np.testing.assert_array_equal(packed, stream[:len(packed)])
        logged = next(r.getMessage() for r in caplog.records if " unit(s) of about " in r.getMessage())
        assert ("one document per tokenizer input" in logged) is not joined, logged


def test_a_document_holding_the_eos_text_keeps_its_ids_and_the_split_counts(tmp_path):
    corpus = tmp_path / "eos"
    corpus.mkdir()
    (corpus / "a.txt").write_text("\n\n".join(f"paragraph {i} <|endoftext|> inside" if i % 5 == 0 else
                                              f"plain paragraph {i} " + "word " * i for i in range(200)) + "\n")
    result = prepare_dataset(config(tmp_path, dataset=str(corpus / "a.txt"), num_workers=1, block_size=16,
                                    val_fraction=0.2))
    manifest = storage.read_json(result.manifest_url)
    assert manifest["splits"]["train"]["documents"] + manifest["splits"]["validation"]["documents"] == 200


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
    first = prepare_dataset(config(tmp_path, num_workers=1, tokenizer="bpe:300"))
    tokenizer_dir = Path(first.manifest_url).parent / "tokenizer"
    for path in tokenizer_dir.iterdir():
        storage.upload_file(path, f"{s3_bucket}/tok/{path.name}")
    local = plan_tokenizer(config(tmp_path, tokenizer=str(tokenizer_dir)))
    remote = plan_tokenizer(config(tmp_path, tokenizer=f"{s3_bucket}/tok"))
    assert remote.fingerprint == local.fingerprint and remote.dtype == "uint16"

    storage.write_json_atomic(f"{s3_bucket}/model/config.json", {"model_type": "gpt2", "n_positions": 16})
    with pytest.raises(PrepareError, match=r"'block_size' = 32 exceeds what model 's3://.*/model' allows"):
        check_model(config(tmp_path, model=f"{s3_bucket}/model"))


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
    assert [f.relpath for f in by_url] == sorted(p.name for p in SAMPLE.glob("*.txt"))


@pytest.mark.parametrize("contents", ["", "\n\n\n\n"])
def test_empty_dataset_is_refused(tmp_path, contents):
    (tmp_path / "empty.txt").write_text(contents, encoding="utf-8")
    cfg = config(tmp_path, dataset=str(tmp_path / "empty.txt"))
    with pytest.raises(PrepareError, match=r"has no documents: .*empty.txt"):
        prepare_dataset(cfg)
    assert_nothing_published(cfg)


def test_missing_text_column_names_the_fields(tmp_path):
    (tmp_path / "rows.jsonl").write_text('{"body": "a"}\n{"body": "b"}\n', encoding="utf-8")
    cfg = config(tmp_path, dataset=str(tmp_path / "rows.jsonl"), text_column="content")
    with pytest.raises(PrepareError, match=r"'text_column' = 'content' is not a field .* has fields \['body'\]"):
        prepare_dataset(cfg)
    assert_nothing_published(cfg)


def test_a_parquet_file_without_the_text_column_is_refused_before_tokenizing(tmp_path, caplog):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"body": ["a b c"] * 50}), tmp_path / "rows.parquet")
    cfg = config(tmp_path, dataset=str(tmp_path / "rows.parquet"))
    with caplog.at_level(logging.INFO, logger="gpt_finetune.prepare"), \
            pytest.raises(PrepareError, match=r"'text_column' = 'text' is not a column of .*rows.parquet: the columns "
                                              r"are \['body'\]"):
        prepare_dataset(cfg)
    assert not any(r.getMessage().startswith("tokenizing") for r in caplog.records)
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


def test_bfloat16_on_the_wire_is_refused_for_a_model_whose_weights_are_not_floating_point(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_positions": 64, "torch_dtype": "int8"}))
    cfg = config(tmp_path, model=str(model), block_size=32, allreduce_dtype="bfloat16")
    with pytest.raises(PrepareError, match=r"'allreduce_dtype' = 'bfloat16' needs floating-point weights, but model "
                                           r".* holds int8: set 'allreduce_dtype' to 'float32'"):
        prepare_dataset(cfg)
    assert not (tmp_path / "storage").exists()
    check_model(config(tmp_path, model=str(model), block_size=32))  # float32 on the wire sends what there is


def test_unwritable_storage_root_fails_before_tokenizing(tmp_path, caplog):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    cfg = config(tmp_path, storage_root=str(blocker / "storage"))
    with caplog.at_level(logging.INFO, logger="gpt_finetune.prepare"), \
            pytest.raises(PrepareError, match=r"'storage_root' = .*a-file/storage' cannot be written"):
        prepare_dataset(cfg)
    messages = [record.getMessage() for record in caplog.records]
    assert messages and messages[0].startswith("dataset ")  # the stage's log is captured: its absence below counts
    assert not any(m.startswith(("training a byte-level BPE", "tokenizing")) for m in messages), messages


def test_missing_bucket_is_an_unwritable_storage_root(tmp_path, s3_env):
    with pytest.raises(PrepareError, match=r"'storage_root' = 's3://no-such-bucket/x' cannot be written"):
        prepare_dataset(config(tmp_path, storage_root="s3://no-such-bucket/x"))


@pytest.mark.parametrize(("setting", "value"), [("prepare_tasks", -1), ("prepare_tasks", 257),
                                                ("prepare_unit_mb", -2), ("bpe_sample_mb", 0)])
def test_prepare_settings_out_of_range_are_refused(tmp_path, setting, value):
    with pytest.raises(ConfigError, match=rf"Setting '{setting}' = {value} is out of range"):
        config(tmp_path, **{setting: value})


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
        assert masked_crc32c(data) == masked_crc32c(data.tobytes()) == masked(reference_crc32c(data.tobytes()))


def test_an_s3_corpus_is_streamed_without_a_local_copy(tmp_path, s3_faults, s3_faulty_bucket, monkeypatch):
    """What the S3 server sends is about the corpus once: ranged reads of each unit, no whole-file download."""
    from tests.tasks.dataset.test_units import _text_corpus

    corpus = _text_corpus(tmp_path / "corpus")
    for path in corpus.iterdir():
        storage.upload_file(path, f"{s3_faulty_bucket}/corpus/{path.name}")
    source_bytes = sum(path.stat().st_size for path in corpus.iterdir())
    tokenizer = Path(prepare_dataset(config(tmp_path, num_workers=1)).manifest_url).parent / "tokenizer"
    monkeypatch.setattr(storage, "download_file", lambda *a: pytest.fail(f"a whole-file download: {a}"))
    cfg = config(tmp_path, dataset=f"{s3_faulty_bucket}/corpus/*.txt", tokenizer=str(tokenizer), block_size=64,
                 storage_root=str(tmp_path / "local-root"))
    for tasks in (1, 3):
        before = s3_faults.got_bytes
        result = prepare_dataset(cfg.replace(prepare_tasks=tasks, prepare_unit_mb=1))
        ratio = (s3_faults.got_bytes - before) / source_bytes
        print(f"\n{tasks} task(s): {s3_faults.got_bytes - before} bytes from S3 for {source_bytes} of corpus: "
              f"{ratio:.4f}x")
        assert 1.0 <= ratio <= 1.01
        storage.remove_tree(str(Path(result.manifest_url).parent))
