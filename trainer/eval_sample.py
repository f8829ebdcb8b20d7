"""The evaluation sample: a bounded, deterministic set of validation sequences, each worker's part of it, and
reading a part without the rest of the split.

The validation split is cut into chunks of at most one evaluation batch of consecutive sequences, never across a
TFRecord record. Each chunk gets a key, splitmix64 of a seed drawn from the dataset's fingerprint plus the chunk's
position in the split; the sample is the chunks of lowest key until `eval_tokens // block_size` sequences (the last
chunk cut short), evaluated in file order. So the sample is the same for every model of a run and for every run
on the same dataset, a larger `eval_tokens` extends a smaller one's sample, and `eval_tokens` 0 (or one past the
split's size) takes every sequence in file order. Worker r of N evaluates sequences [r*n/N, (r+1)*n/N) of the
sample's n.

A part is read with ranged reads of its records' bytes (one request per contiguous run on object storage): every
record of a shard but its last holds `sequences_per_record` sequences (docs/CONTRACTS.md), so where a sequence lies
follows from the manifest. A record read whole is checked against its TFRecord checksums; a part of a record has
none of its own.
No TensorFlow here: the tasks use the sample's identity (the baseline key, promotion's comparison).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from core import storage
from core.config.core import EVAL_BATCH_SEQUENCES
from trainer.data import DataError, dataset_dir

SAMPLE_RULE = "splitmix64-chunk-key/v1"
_FRAME_BYTES = 16  # uint64 length, its masked CRC-32C, then the data's masked CRC-32C after the data
_MASK_DELTA = 0xA282EAD8
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


@dataclass(frozen=True)
class Piece:
    """Consecutive sequences [start, start + count) of validation shard `shard` (its index in the manifest), all in
    record `record`."""

    shard: int
    record: int
    start: int
    count: int


@dataclass(frozen=True)
class EvalSample:
    identity: dict[str, Any]  # sample_identity(): what the result, the baseline key and promotion compare
    pieces: tuple[Piece, ...]  # file order

    @property
    def sample_id(self) -> str:
        return self.identity["id"]

    @property
    def sequences(self) -> int:
        return self.identity["sequences"]

    def part(self, rank: int, num_workers: int) -> list[Piece]:
        """Worker `rank`'s share: sequences [rank*n/N, (rank+1)*n/N) of the sample, in sample order."""
        if not 0 <= rank < num_workers:
            raise DataError(f"Rank {rank} is outside a group of {num_workers} workers.")
        low, high = rank * self.sequences // num_workers, (rank + 1) * self.sequences // num_workers
        part, before = [], 0
        for piece in self.pieces:
            first, last = max(low, before), min(high, before + piece.count)
            if first < last:
                part.append(Piece(piece.shard, piece.record, piece.start + first - before, last - first))
            before += piece.count
            if before >= high:
                break
        return part


def sample_identity(manifest: dict[str, Any], eval_tokens: int) -> dict[str, Any]:
    """The sample's identity without drawing it: `id` (a digest of the rule, the validation shards and the size),
    its sequences and tokens against the split's, and whether it is the whole split."""
    split = _validation(manifest)
    block = manifest["block_size"]
    total = split["sequences"]
    wanted = total if eval_tokens == 0 else min(total, eval_tokens // block)
    digest = hashlib.sha256(json.dumps({
        "rule": SAMPLE_RULE, "fingerprint": manifest["fingerprint"], "block_size": block,
        "sequences_per_record": manifest["sequences_per_record"], "chunk": EVAL_BATCH_SEQUENCES,
        "shards": [[shard["name"], shard["sequences"], shard["sha256"]] for shard in split["shards"]],
        "sequences": wanted,
    }, sort_keys=True).encode()).hexdigest()
    return {"id": f"{manifest['fingerprint'][:12]}-{wanted}-{digest[:12]}", "rule": SAMPLE_RULE,
            "asked_tokens": eval_tokens, "sequences": wanted, "tokens": wanted * block,
            "split_sequences": total, "split_tokens": total * block, "whole_split": wanted == total}


def draw_sample(manifest: dict[str, Any], eval_tokens: int) -> EvalSample:
    """The sample of `eval_tokens` tokens of the manifest's validation split (0: all of it)."""
    identity = sample_identity(manifest, eval_tokens)
    shards, records, starts, counts = _chunks(manifest)
    wanted = identity["sequences"]
    if identity["whole_split"]:
        chosen, cut = np.arange(len(counts)), None
    else:
        seed = int.from_bytes(hashlib.blake2b(f"{SAMPLE_RULE}:{manifest['fingerprint']}".encode(),
                                              digest_size=8).digest(), "little")
        order = np.argsort(_splitmix64(seed, len(counts)), kind="stable")
        taken = np.cumsum(counts[order])
        last = int(np.searchsorted(taken, wanted))  # the chunk that reaches `wanted` sequences
        cut = (int(order[last]), wanted - int(taken[last - 1] if last else 0))
        chosen = np.sort(order[:last + 1])
    pieces = []
    for index in chosen.tolist():
        count = cut[1] if cut and index == cut[0] else int(counts[index])
        pieces.append(Piece(int(shards[index]), int(records[index]), int(starts[index]), count))
    return EvalSample(identity, tuple(_coalesce(pieces)))


def _validation(manifest: dict[str, Any]) -> dict[str, Any]:
    split = manifest["splits"].get("validation")
    if not split or not split["sequences"]:
        raise DataError("The validation split has no sequences to evaluate: prepare more validation data "
                        "(raise 'val_fraction').")
    return split


def _record_sizes(sequences: int, per_record: int) -> np.ndarray:
    """Sequences of each record of a shard: `per_record` but the last."""
    records = -(-sequences // per_record)
    sizes = np.full(records, per_record, dtype=np.int64)
    if records:
        sizes[-1] = sequences - (records - 1) * per_record
    return sizes


def _chunks(manifest: dict[str, Any]) -> tuple[np.ndarray, ...]:
    """Every chunk of the split in file order: (shard, record, first sequence in the shard, sequences)."""
    per_record = manifest["sequences_per_record"]
    columns: list[list[np.ndarray]] = [[], [], [], []]
    for index, shard in enumerate(_validation(manifest)["shards"]):
        sizes = _record_sizes(shard["sequences"], per_record)
        per = -(-sizes // EVAL_BATCH_SEQUENCES)  # chunks of each record
        record = np.repeat(np.arange(len(sizes)), per)
        within = np.arange(int(per.sum())) - np.repeat(np.cumsum(per) - per, per)  # chunk index in its record
        offset = within * EVAL_BATCH_SEQUENCES
        for column, values in zip(columns, (np.full(len(record), index), record, record * per_record + offset,
                                            np.minimum(EVAL_BATCH_SEQUENCES, sizes[record] - offset)), strict=True):
            column.append(values.astype(np.int64))
    return tuple(np.concatenate(column) for column in columns)


def _splitmix64(seed: int, count: int) -> np.ndarray:
    """The first `count` outputs of splitmix64 seeded with `seed` (uint64, wrapping arithmetic)."""
    with np.errstate(over="ignore"):
        z = np.uint64(seed) + (np.arange(count, dtype=np.uint64) + np.uint64(1)) * _GOLDEN
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))


def _coalesce(pieces: Sequence[Piece]) -> list[Piece]:
    """Adjacent pieces of one record as one piece (fewer, larger reads)."""
    merged: list[Piece] = []
    for piece in pieces:
        previous = merged[-1] if merged else None
        if previous and (previous.shard, previous.record) == (piece.shard, piece.record) and (
                previous.start + previous.count == piece.start):
            merged[-1] = Piece(piece.shard, piece.record, previous.start, previous.count + piece.count)
        else:
            merged.append(piece)
    return merged


# ---------------------------------------------------------------------------------------------------------------
# reading a part


WINDOW_BYTES = 64 << 20  # a part is read and scored in windows of about this many bytes: bounded memory


def read_part(manifest_url: str, manifest: dict[str, Any], pieces: Sequence[Piece]) -> tuple[np.ndarray, int]:
    """The part's sequences as int32 `[n, block_size]` in the pieces' order, and the bytes read from storage."""
    windows = list(read_windows(manifest_url, manifest, pieces, window_bytes=None))
    if not windows:
        return np.zeros((0, manifest["block_size"]), dtype=np.int32), 0
    return np.concatenate([tokens for tokens, _ in windows]), sum(read for _, read in windows)


def read_windows(manifest_url: str, manifest: dict[str, Any], pieces: Sequence[Piece],
                 window_bytes: int | None = WINDOW_BYTES) -> Iterator[tuple[np.ndarray, int]]:
    """The part's sequences in order, as int32 `[n, block_size]` windows of about `window_bytes` (None: one), each
    with the bytes read for it: one batch of ranged requests per window."""
    block, per_record = manifest["block_size"], manifest["sequences_per_record"]
    row_bytes = block * np.dtype(manifest["dtype"]).itemsize
    stride = _FRAME_BYTES + per_record * row_bytes
    shards = _validation(manifest)["shards"]
    for index in {piece.shard for piece in pieces}:
        _check_layout(shards[index], per_record, row_bytes)
    dtype = np.dtype(manifest["dtype"]).newbyteorder("<")
    ranges: list[tuple[str, int, int, bool]] = []
    size = 0
    for piece in pieces:
        shard = shards[piece.shard]
        record_start = piece.record * stride
        in_record = min(per_record, shard["sequences"] - piece.record * per_record)
        if piece.count == in_record:  # the framed record, checksums and all
            ranges.append((shard["name"], record_start, record_start + _FRAME_BYTES + in_record * row_bytes, True))
        else:
            first = record_start + 12 + (piece.start - piece.record * per_record) * row_bytes
            ranges.append((shard["name"], first, first + piece.count * row_bytes, False))
        size += ranges[-1][2] - ranges[-1][1]
        if window_bytes is not None and size >= window_bytes:
            yield _window(manifest_url, ranges, dtype, block)
            ranges, size = [], 0
    if ranges:
        yield _window(manifest_url, ranges, dtype, block)


def _window(manifest_url: str, ranges: list[tuple[str, int, int, bool]], dtype: np.dtype,
            block: int) -> tuple[np.ndarray, int]:
    blobs = _read_ranges(dataset_dir(manifest_url), [(name, start, end) for name, start, end, _ in ranges])
    rows = [np.frombuffer(_payload(blob, name) if framed else blob, dtype=dtype)
            for blob, (name, _, _, framed) in zip(blobs, ranges, strict=True)]
    return np.concatenate(rows).astype(np.int32).reshape(-1, block), sum(len(blob) for blob in blobs)


def leading_records(manifest_url: str, manifest: dict[str, Any], split: str,
                    max_tokens: int) -> tuple[list[np.ndarray], int]:
    """The first records of `split`, shard after shard, until `max_tokens` tokens (the record that reaches them
    included): each record's tokens, checksums checked, and the bytes read."""
    block, per_record = manifest["block_size"], manifest["sequences_per_record"]
    row_bytes = block * np.dtype(manifest["dtype"]).itemsize
    ranges, remaining = [], max_tokens
    for shard in manifest["splits"][split]["shards"]:
        if remaining <= 0:
            break
        _check_layout(shard, per_record, row_bytes)
        sizes = _record_sizes(shard["sequences"], per_record)
        count = min(len(sizes), int(np.searchsorted(np.cumsum(sizes * block), remaining)) + 1)
        if count:
            ranges.append((shard["name"], 0, count * _FRAME_BYTES + int(sizes[:count].sum()) * row_bytes))
        remaining -= int(sizes[:count].sum()) * block
    blobs = _read_ranges(dataset_dir(manifest_url), ranges)
    dtype = np.dtype(manifest["dtype"]).newbyteorder("<")
    records = []
    for blob, (name, _, _) in zip(blobs, ranges, strict=True):
        offset = 0
        while offset < len(blob):
            end = offset + _FRAME_BYTES + int.from_bytes(blob[offset:offset + 8], "little")
            records.append(np.frombuffer(_payload(blob[offset:end], name), dtype=dtype))
            offset = end
    return records, sum(len(blob) for blob in blobs)


def _check_layout(shard: dict[str, Any], per_record: int, row_bytes: int) -> None:
    records = len(_record_sizes(shard["sequences"], per_record))
    expected = records * _FRAME_BYTES + shard["sequences"] * row_bytes
    if shard["bytes"] != expected:
        raise DataError(
            f"Shard {shard['name']} has {shard['bytes']} bytes where {records} records of "
            f"{per_record} sequences (the last may hold fewer) take {expected}: its records are not laid out as "
            "docs/CONTRACTS.md says, so evaluation cannot read parts of it. Prepare the dataset again.")


def _read_ranges(directory: str, ranges: Sequence[tuple[str, int, int]]) -> list[bytes]:
    """The byte ranges [(shard name, start, end)], in one batch of ranged requests."""
    if not ranges:
        return []
    fs, root = storage.filesystem(directory)
    paths = [f"{root.rstrip('/')}/{name}" for name, _, _ in ranges]
    try:
        blobs = fs.cat_ranges(paths, [start for _, start, _ in ranges], [end for _, _, end in ranges],
                              on_error="raise")
    except FileNotFoundError as error:
        raise DataError(f"A shard under {directory} is missing ({error}): prepare the dataset "
                        "again.") from error
    for blob, (name, start, end) in zip(blobs, ranges, strict=True):
        if len(blob) != end - start:
            raise DataError(f"Shard {storage.join(directory, name)} ends before byte {end}: it is "
                            "truncated. Delete the dataset and run the prepare task again.")
    return blobs


def _payload(framed: bytes, name: str) -> bytes:
    """A whole TFRecord record's data after checking its length and both checksums."""
    import google_crc32c

    length = int.from_bytes(framed[:8], "little")
    checks = (length == len(framed) - _FRAME_BYTES
              and _masked_crc(google_crc32c, framed[:8]) == int.from_bytes(framed[8:12], "little")
              and _masked_crc(google_crc32c, framed[12:-4]) == int.from_bytes(framed[-4:], "little"))
    if not checks:
        raise DataError(f"Shard {name} has a damaged record (length or checksum): delete the dataset "
                        "and run the prepare task again.")
    return framed[12:-4]


def _masked_crc(crc32c, data: bytes) -> int:
    crc = crc32c.value(data)
    return ((((crc >> 15) | (crc << 17)) & 0xFFFFFFFF) + _MASK_DELTA) & 0xFFFFFFFF
