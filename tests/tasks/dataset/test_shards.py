"""The units' streams as one stream per split: in unit order, and the rule "at least one validation document, never
all" applied by moving one document's span between the splits, located by what its unit recorded."""

from __future__ import annotations

import numpy as np
import pytest

from tasks.dataset.records import Extreme, SplitStream, UnitResult
from tasks.dataset.shards import Stream, split_streams, write_split
from tests.tasks.dataset.corpus import read_tfrecords


def _unit(tmp_path, index: int, train: list[list[int]], validation: list[list[int]], draws: dict) -> UnitResult:
    splits = {}
    for split, documents in (("train", train), ("validation", validation)):
        tokens = [t for doc in documents for t in doc]
        data = np.array(tokens, dtype="<u2").tobytes()
        (tmp_path / f"{index}.{split}.bin").write_bytes(data)
        extreme = None
        if documents:
            pick = draws[split]
            offset = sum(len(doc) for doc in documents[:pick])
            extreme = Extreme(draw=draws[f"{split}_draw"], offset=offset, tokens=len(documents[pick]))
        splits[split] = SplitStream(documents=len(documents), tokens=len(tokens), bytes=len(data), sha256="",
                                    extreme=extreme)
    return UnitResult(plan_id="0" * 12, unit=index, splits=splits, bytes=0, fetched_bytes=0, wall_s=0.0, cpu_s=0.0)


def _tokens(stream: Stream) -> list[int]:
    return [int(t) for piece in stream.read(0, stream.tokens) for t in piece]


def test_streams_follow_unit_order(tmp_path):
    results = [_unit(tmp_path, 0, [[1, 2], [3]], [[9, 9]], {"train": 1, "train_draw": 0.3, "validation": 0,
                                                           "validation_draw": 0.01}),
               _unit(tmp_path, 1, [[4, 5, 6]], [[8]], {"train": 0, "train_draw": 0.2, "validation": 0,
                                                       "validation_draw": 0.02})]
    streams, documents = split_streams(results, lambda unit, split: str(tmp_path / f"{unit}.{split}.bin"), "uint16")
    assert _tokens(streams["train"]) == [1, 2, 3, 4, 5, 6] and _tokens(streams["validation"]) == [9, 9, 8]
    assert documents == {"train": 3, "validation": 2}


def test_no_validation_document_moves_the_lowest_draw_training_document(tmp_path):
    results = [_unit(tmp_path, 0, [[1, 2], [3, 4, 5]], [], {"train": 1, "train_draw": 0.4}),
               _unit(tmp_path, 1, [[6], [7, 7], [8]], [], {"train": 1, "train_draw": 0.1})]
    streams, documents = split_streams(results, lambda unit, split: str(tmp_path / f"{unit}.{split}.bin"), "uint16")
    assert _tokens(streams["validation"]) == [7, 7]  # unit 1's second document: the lowest draw of all
    assert _tokens(streams["train"]) == [1, 2, 3, 4, 5, 6, 8]
    assert documents == {"train": 4, "validation": 1}


def test_no_training_document_moves_the_highest_draw_validation_document(tmp_path):
    results = [_unit(tmp_path, 0, [], [[1], [2, 2]], {"validation": 0, "validation_draw": 0.9}),
               _unit(tmp_path, 1, [], [[3, 3, 3]], {"validation": 0, "validation_draw": 0.2})]
    streams, documents = split_streams(results, lambda unit, split: str(tmp_path / f"{unit}.{split}.bin"), "uint16")
    assert _tokens(streams["train"]) == [1] and _tokens(streams["validation"]) == [2, 2, 3, 3, 3]
    assert documents == {"train": 1, "validation": 2}


@pytest.mark.parametrize("read_tokens", [3, 1 << 21])
def test_shards_hold_whole_records_across_reads(tmp_path, monkeypatch, read_tokens):
    monkeypatch.setattr("tasks.dataset.shards.READ_TOKENS", read_tokens)
    tokens = list(range(100))
    (tmp_path / "0.train.bin").write_bytes(np.array(tokens[:37], dtype="<u2").tobytes())
    (tmp_path / "1.train.bin").write_bytes(np.array(tokens[37:], dtype="<u2").tobytes())
    from tasks.dataset.shards import Segment

    stream = Stream([Segment(str(tmp_path / "0.train.bin"), 0, 37), Segment(str(tmp_path / "1.train.bin"), 0, 63)],
                    "uint16")
    entry = write_split(stream, "train", 3, block_size=4, per_record=2, stage=tmp_path, documents=5)
    assert entry.sequences == 25 and [s.sequences for s in entry.shards] == [8, 8, 9] and entry.documents == 5
    records = [r for s in entry.shards for r in read_tfrecords((tmp_path / s.name).read_bytes())]
    assert [len(r) // 8 for r in records] == [2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 1]
    assert np.concatenate([np.frombuffer(r, "<u2") for r in records]).tolist() == tokens
