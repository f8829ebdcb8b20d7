"""The units' streams as one stream per split, cut into `block_size` sequences and equal TFRecord shards.

A split's stream is its units' streams in unit order (source order: file, then position), so it is the same for
any unit size and any fan-out. The draws hold out documents independently, which can leave a split empty on a
small corpus; then the stage's rule "at least one validation document, never all" moves one document: the training
document with the lowest draw to validation, or the validation document with the highest draw to training,
located by the span its unit recorded, without tokenizing again. Shards are cut as always: the stream's whole
sequences (the remainder is dropped), `shards` files whose sequence counts differ by at most one.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from core import storage
from core.layout import shard_name
from tasks.dataset.encode import SPLITS
from tasks.dataset.manifest import ShardEntry, SplitEntry
from tasks.dataset.records import UnitResult
from tasks.tfrecord import write_sequence_records

READ_TOKENS = 1 << 21  # tokens read from the units' streams per step when writing a shard


@dataclass(frozen=True)
class Segment:
    url: str  # a unit's split stream
    start: int  # first token
    end: int  # exclusive

    @property
    def tokens(self) -> int:
        return self.end - self.start


class Stream:
    """A split's tokens, as segments of the units' streams."""

    def __init__(self, segments: Sequence[Segment], dtype: str) -> None:
        self.segments = [s for s in segments if s.tokens]
        self.dtype = np.dtype(dtype).newbyteorder("<")
        self.tokens = sum(s.tokens for s in self.segments)

    def read(self, start: int, end: int) -> Iterator[np.ndarray]:
        """Tokens [start, end) of the stream, in pieces of at most READ_TOKENS."""
        before = 0
        for segment in self.segments:
            low, high = max(start, before), min(end, before + segment.tokens)
            position = low
            while position < high:
                stop = min(high, position + READ_TOKENS)
                first = segment.start + position - before
                data = storage.read_range(segment.url, first * self.dtype.itemsize,
                                          (first + stop - position) * self.dtype.itemsize)
                yield np.frombuffer(data, dtype=self.dtype)
                position = stop
            before += segment.tokens
            if before >= end:
                return


def split_streams(results: Sequence[UnitResult], stream_url, dtype: str) -> tuple[dict[str, Stream], dict[str, int]]:
    """Each split's stream over the units' results (in unit order) and its document count, after the rule that
    keeps at least one validation document and never all of them."""
    segments = {split: [Segment(stream_url(r.unit, split), 0, r.splits[split].tokens) for r in results]
                for split in SPLITS}
    documents = {split: sum(r.splits[split].documents for r in results) for split in SPLITS}
    for donor, receiver, pick in (("train", "validation", min), ("validation", "train", max)):
        if documents[receiver] or documents[donor] < 2:
            continue
        extremes = [(extreme, index) for index, r in enumerate(results)
                    if (extreme := r.splits[donor].extreme) is not None]
        extreme, index = pick(extremes, key=lambda item: item[0].draw)
        moved = segments[donor][index]
        low, high = extreme.offset, extreme.offset + extreme.tokens
        segments[donor][index:index + 1] = [Segment(moved.url, 0, low), Segment(moved.url, high, moved.end)]
        segments[receiver] = [Segment(moved.url, low, high)]
        documents[donor] -= 1
        documents[receiver] += 1
        break  # only one split can be empty
    return {split: Stream(segments[split], dtype) for split in SPLITS}, documents


def write_split(stream: Stream, split: str, shards: int, block_size: int, per_record: int, stage: Path, *,
                documents: int) -> SplitEntry:
    """Cut the stream (of `documents` documents) into `block_size` sequences (dropping the remainder) and write
    `shards` files whose sequence counts differ by at most one."""
    sequences = stream.tokens // block_size
    entries = []
    for index in range(shards):
        low, high = index * sequences // shards, (index + 1) * sequences // shards
        name = shard_name(split, index, shards)
        path = stage / name
        records = 0
        with open(path, "wb") as handle:
            carry = np.zeros(0, dtype=stream.dtype)
            for piece in stream.read(low * block_size, high * block_size):
                tokens = np.concatenate([carry, piece]) if len(carry) else piece
                whole = len(tokens) // (block_size * per_record) * per_record  # records stay full across reads
                rows = tokens[: whole * block_size].reshape(whole, block_size)
                records += write_sequence_records(handle, rows, per_record) if whole else 0
                carry = tokens[whole * block_size:]
            if len(carry):
                records += write_sequence_records(handle, carry.reshape(-1, block_size), per_record)
        entries.append(ShardEntry(name=name, records=records, sequences=high - low, tokens=(high - low) * block_size,
                                  bytes=path.stat().st_size, sha256=storage.sha256_file(path)))
    return SplitEntry(documents=documents, sequences=sequences, tokens=sequences * block_size, shards=tuple(entries))
