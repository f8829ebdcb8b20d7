"""trainer/eval_sample.py and core/eval_result.py: a bounded, deterministic sample of the validation split, read
in parts without the rest of it, and the parts' results combined exactly. No TensorFlow: shards written by the
prepare stage's own TFRecord writer, losses given."""

from __future__ import annotations

import hashlib
import itertools
import json
import math
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from core.document import DocumentError
from core.eval_result import (
    EvalPart,
    EvalResult,
    ResultError,
    combine,
    delta_standard_error,
    paired_standard_error,
    standard_error,
)
from tasks.tfrecord import write_sequence_records
from trainer import eval_sample
from trainer.data import DataError
from trainer.eval_sample import draw_sample, leading_records, read_part, sample_identity

BLOCK, PER_RECORD = 4, 20  # chunks of 8 sequences: two full and one of 4 per full record


def write_split(directory: Path, split: str, shard_sequences: list[int], seed: int) -> tuple[list[dict], np.ndarray]:
    """Shards as prepare writes them (records of PER_RECORD sequences, the last shorter); every token encodes its
    sequence's number in the split, so a read sequence says where it came from."""
    shards, rows, first = [], [], 0
    for index, count in enumerate(shard_sequences):
        sequences = np.arange(first, first + count, dtype=np.uint16)[:, None].repeat(BLOCK, axis=1)
        sequences[:, 1:] = (sequences[:, 1:] + seed) % 60_000  # the sequence's number first
        name = f"{split}-{index:05d}-of-{len(shard_sequences):05d}.tfrecord"
        with open(directory / name, "wb") as handle:
            records = write_sequence_records(handle, sequences, PER_RECORD)
        data = (directory / name).read_bytes()
        shards.append({"name": name, "records": records, "sequences": count, "tokens": count * BLOCK,
                       "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()})
        rows.append(sequences)
        first += count
    return shards, np.concatenate(rows).astype(np.int32)


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    directory = tmp_path_factory.mktemp("eval-sample")
    validation, rows = write_split(directory, "validation", [107, 93, 60], seed=0)
    train, _ = write_split(directory, "train", [45, 45], seed=7)
    manifest = {"format_version": 1, "fingerprint": "f" * 20, "dtype": "uint16", "block_size": BLOCK,
                "sequences_per_record": PER_RECORD,
                "splits": {"validation": {"sequences": 260, "tokens": 260 * BLOCK, "shards": validation},
                           "train": {"sequences": 90, "tokens": 90 * BLOCK, "shards": train}}}
    return str(directory / "manifest.json"), manifest, rows


def sequence_numbers(tokens: np.ndarray) -> list[int]:
    return tokens[:, 0].tolist()


def test_the_sample_is_bounded_the_same_every_time_and_grows_by_extension(dataset):
    _, manifest, _ = dataset
    sample = draw_sample(manifest, 40 * BLOCK)
    assert sample.sequences == 40 == sum(piece.count for piece in sample.pieces)
    assert draw_sample(manifest, 40 * BLOCK) == sample and sample.sample_id == sample_identity(manifest, 160)["id"]
    assert sample.identity["tokens"] == 160 and sample.identity["split_tokens"] == 1040
    assert not sample.identity["whole_split"]
    larger = draw_sample(manifest, 100 * BLOCK)
    assert {(p.shard, p.start) for p in sample.pieces if p.count == 8} <= _sequence_set(larger)
    assert larger.sample_id != sample.sample_id
    # Spread over the split, not its opening: chunks from every shard.
    assert {piece.shard for piece in larger.pieces} == {0, 1, 2}
    # Another dataset (fingerprint), another sample of the same size.
    other = draw_sample({**manifest, "fingerprint": "e" * 20}, 40 * BLOCK)
    assert _sequence_set(other) != _sequence_set(sample)


def _sequence_set(sample) -> set[tuple[int, int]]:
    return {(piece.shard, start) for piece in sample.pieces for start in range(piece.start, piece.start + piece.count)}


@pytest.mark.parametrize("eval_tokens", [0, 260 * BLOCK, 10_000 * BLOCK])
def test_zero_or_more_than_the_split_takes_all_of_it_in_file_order(dataset, eval_tokens):
    manifest_url, manifest, rows = dataset
    sample = draw_sample(manifest, eval_tokens)
    assert sample.identity["whole_split"] and sample.sequences == 260
    assert sample.identity["asked_tokens"] == eval_tokens
    tokens, _ = read_part(manifest_url, manifest, sample.part(0, 1))
    assert np.array_equal(tokens, rows)  # every record read whole, its checksums checked


@pytest.mark.parametrize("workers", [1, 2, 3, 7])
def test_parts_are_disjoint_and_read_only_the_sample(dataset, workers):
    manifest_url, manifest, rows = dataset
    sample = draw_sample(manifest, 50 * BLOCK)
    whole, _ = read_part(manifest_url, manifest, sample.part(0, 1))
    read = [read_part(manifest_url, manifest, sample.part(rank, workers)) for rank in range(workers)]
    numbers = [number for tokens, _ in read for number in sequence_numbers(tokens)]
    assert numbers == sequence_numbers(whole) and len(set(numbers)) == 50  # disjoint, in sample order
    assert np.array_equal(np.concatenate([tokens for tokens, _ in read]), rows[numbers])
    # Bytes read: the sample's tokens, plus the framing of any record read whole.
    assert sum(count for _, count in read) <= 50 * BLOCK * 2 + 16 * len(sample.pieces)


def test_a_part_is_read_in_bounded_windows(dataset):
    manifest_url, manifest, rows = dataset
    pieces = draw_sample(manifest, 0).part(0, 1)
    windows = list(eval_sample.read_windows(manifest_url, manifest, pieces, window_bytes=500))
    assert len(windows) > 3 and all(len(tokens) <= 500 // (BLOCK * 2) + PER_RECORD for tokens, _ in windows)
    assert np.array_equal(np.concatenate([tokens for tokens, _ in windows]), rows)
    assert sum(read for _, read in windows) == read_part(manifest_url, manifest, pieces)[1]


def test_a_damaged_record_read_whole_is_refused(dataset, tmp_path):
    manifest_url, manifest, _ = dataset
    damaged = tmp_path / Path(manifest["splits"]["validation"]["shards"][0]["name"])
    data = bytearray((Path(manifest_url).parent / damaged.name).read_bytes())
    data[40] ^= 0xFF
    damaged.write_bytes(bytes(data))
    for shard in manifest["splits"]["validation"]["shards"][1:]:
        (tmp_path / shard["name"]).write_bytes((Path(manifest_url).parent / shard["name"]).read_bytes())
    with pytest.raises(DataError, match=f"Shard {damaged.name} has a damaged record"):
        read_part(str(tmp_path / "manifest.json"), manifest, draw_sample(manifest, 0).part(0, 1))


def test_a_shard_laid_out_otherwise_is_refused_by_name(dataset):
    manifest_url, manifest, _ = dataset
    shards = [dict(shard) for shard in manifest["splits"]["validation"]["shards"]]
    shards[1]["bytes"] += 4
    bent = {**manifest, "splits": {**manifest["splits"], "validation": {
        **manifest["splits"]["validation"], "shards": shards}}}
    with pytest.raises(DataError, match=f"Shard {shards[1]['name']} has .* not laid out as docs/CONTRACTS.md says"):
        read_part(manifest_url, bent, draw_sample(bent, 0).part(0, 1))


def test_an_empty_validation_split_is_refused():
    manifest = {"fingerprint": "x", "block_size": 4, "sequences_per_record": 2,
                "splits": {"validation": {"sequences": 0, "tokens": 0, "shards": []}}}
    with pytest.raises(DataError, match="validation split has no sequences"):
        sample_identity(manifest, 0)


def test_the_training_vocabulary_reads_only_the_leading_records(dataset, monkeypatch):
    manifest_url, manifest, _ = dataset
    records, read = leading_records(manifest_url, manifest, "train", 30 * BLOCK)
    assert [len(record) for record in records] == [PER_RECORD * BLOCK, PER_RECORD * BLOCK]  # 40 sequences >= 30
    assert read == 2 * (16 + PER_RECORD * BLOCK * 2)
    everything, _ = leading_records(manifest_url, manifest, "train", 10**9)
    assert sum(len(record) for record in everything) == 90 * BLOCK


# ---------------------------------------------------------------------------------------------------------------
# combining the parts


def part(rank: int, workers: int, losses: list[float], sample: dict, model: str = "m") -> EvalPart:
    return EvalPart(rank=rank, num_workers=workers, model=model, sample=sample, sequences=len(losses),
                    sequence_losses=tuple(losses), scored_tokens=3 * len(losses), characters=9 * len(losses),
                    read_bytes=8 * len(losses), read_time_s=0.1, eval_time_s=1.0 + rank)


def test_parts_combine_exactly_to_the_whole_result_in_any_order():
    rng = np.random.default_rng(5)
    losses = (rng.normal(4.0, 0.7, 1000) ** 2).astype(np.float32).astype(float).tolist()
    sample = {"id": "s", "sequences": 1000, "split_sequences": 20_000, "tokens": 4000, "split_tokens": 80_000}
    whole = combine([part(0, 1, losses, sample)])
    cuts = [0, 333, 334, 999, 1000]
    parts = [part(rank, 4, losses[low:high], sample) for rank, (low, high) in enumerate(itertools.pairwise(cuts))]
    combined = combine(parts[::-1])
    assert combined.eval_loss == whole.eval_loss == math.fsum(losses) / 1000  # exact, whatever the order
    assert combined.eval_loss_se == whole.eval_loss_se
    assert combined.eval_tokens == 3000 and combined.eval_characters == 9000
    assert combined.eval_time_s == 4.0 and [w["rank"] for w in combined.workers] == [0, 1, 2, 3]
    expected = np.std(losses, ddof=1) / math.sqrt(1000) * math.sqrt((20_000 - 1000) / (20_000 - 1))
    assert whole.eval_loss_se == pytest.approx(expected, rel=1e-9)
    with pytest.raises(ResultError, match=r"ranks \[0, 1, 3\], of a group of 4"):
        combine(parts[:2] + parts[3:])
    with pytest.raises(ResultError, match="different samples"):
        combine([parts[0], replace(parts[1], sample={**sample, "id": "t"}), *parts[2:]])


def test_a_part_reads_back_as_written_and_a_rewritten_one_is_refused():
    written = part(1, 2, [4.0, 4.5], {"id": "s", "sequences": 4})
    assert EvalPart.from_json(json.loads(json.dumps(written.to_json())), "part.json") == written
    with pytest.raises(DocumentError, match=r"part\.json: sequence_losses\[1\]: expected float, got str"):
        EvalPart.from_json({**written.to_json(), "sequence_losses": [4.0, "4.5"]}, "part.json")


def test_standard_errors_whole_split_paired_and_independent():
    assert standard_error([1.0, 2.0, 3.0], population=3) == 0.0  # the whole split: no sampling error
    assert standard_error([1.0], population=10) is None and standard_error([1.0, math.inf], 10) is None
    hard = [5.0, 1.0, 4.0, 2.0, 6.0, 0.5]  # how hard each sequence is dominates both models' losses
    first = [loss + 0.10 for loss in hard]
    second = [loss + 0.05 + (0.01 if index % 2 else -0.01) for index, loss in enumerate(hard)]
    paired = paired_standard_error(first, second, population=600)
    assert paired == pytest.approx(standard_error([a - b for a, b in zip(first, second, strict=True)], 600))
    assert paired < 0.01 < standard_error(first, 600)
    sample = {"id": "s", "split_sequences": 600}
    scores = {"eval_loss": 3.0, "perplexity": 20.0, "eval_tokens": 6 * 63, "eval_time_s": 1.0}
    one = EvalResult.from_json({**scores, "sample": sample, "sequence_losses": first,
                                "eval_loss_se": standard_error(first, 600)}, "one.json")
    two = EvalResult.from_json({**scores, "sample": sample, "sequence_losses": second,
                                "eval_loss_se": standard_error(second, 600)}, "two.json")
    assert delta_standard_error(one, two) == paired
    other = replace(two, sample={**sample, "id": "t"})  # another sample: the two errors together
    assert delta_standard_error(one, other) == pytest.approx(math.hypot(one.eval_loss_se, two.eval_loss_se))
    assert delta_standard_error(one, None) is None


def test_a_result_read_back_is_checked_naming_the_file_and_the_field():
    """eval.json is cached beside a baseline and read back by later runs: storage, so untrusted."""
    scores = {"eval_loss": 3.0, "perplexity": 20.0, "eval_tokens": 63, "eval_time_s": 1, "model": "m"}
    old = EvalResult.from_json(scores, "eval.json")  # a result from before the sample and the samples
    assert (old.sample_id, old.sequence_losses, old.eval_loss_se, old.eval_time_s) == (None, None, None, 1.0)
    with pytest.raises(ResultError, match=r"^eval.json: eval_loss: expected float, got str"):
        EvalResult.from_json({**scores, "eval_loss": "3.0"}, "eval.json")
    with pytest.raises(ResultError, match=r"^eval.json: missing key\(s\) eval_tokens"):
        EvalResult.from_json({k: v for k, v in scores.items() if k != "eval_tokens"}, "eval.json")
    with pytest.raises(ResultError, match=r"^eval.json: sequence_losses\[1\]: expected float, got str"):
        EvalResult.from_json({**scores, "sequence_losses": [1.0, "x"]}, "eval.json")


def test_the_chunk_table_covers_each_record_once():
    manifest = {"sequences_per_record": PER_RECORD, "splits": {"validation": {"sequences": 47, "shards": [
        {"sequences": 27}, {"sequences": 20}]}}}
    shards, records, starts, counts = eval_sample._chunks(manifest)
    assert counts.sum() == 47 and counts.max() == 8
    assert list(zip(shards.tolist(), records.tolist(), starts.tolist(), counts.tolist(), strict=True)) == [
        (0, 0, 0, 8), (0, 0, 8, 8), (0, 0, 16, 4), (0, 1, 20, 7), (1, 0, 0, 8), (1, 0, 8, 8), (1, 0, 16, 4)]
