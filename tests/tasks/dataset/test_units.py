"""Fan-out: the same shards, byte for byte, for any number of tasks and any unit size (text, JSON Lines, Parquet,
with unit cuts inside a multi-byte character, a \\r\\n and a paragraph), a lane SIGKILLed mid-unit whose retry
completes with the same result, and the planning rules (units, lanes, task counts)."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from core import storage
from tasks.dataset.errors import PrepareError
from tasks.dataset.records import Part, Unit
from tasks.dataset.sources import SourceFile, Sources
from tasks.dataset.stage import finish_dataset, plan_dataset, prepare_dataset, run_planned
from tasks.dataset.units import lanes, plan_units, task_count, unit_size
from tests.tasks.dataset.corpus import REPO, WORDS, comparable, config, shard_files

MiB = 1 << 20


def _words(rng, count: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(count))


def _text_corpus(directory: Path) -> Path:
    """Two files: a 3.2 MiB one whose 1 MiB unit cuts fall inside '€', inside a \\r\\n and inside a paragraph,
    with CRLF newlines throughout, and a small one (grouped whole with others)."""
    import random

    rng = random.Random(5)
    directory.mkdir(parents=True, exist_ok=True)
    size = 3 * MiB + 300_000  # 4 pieces of ~0.8 MiB at 1 MiB units
    raw = bytearray()
    while len(raw) < size:
        raw += (_words(rng, rng.randint(20, 200)) + " naïve €uro\r\n" + _words(rng, 30) + "\r\n\r\n").encode()
    raw = raw[:size]
    cuts = [piece * size // 4 for piece in (1, 2, 3)]
    raw[cuts[0] - 2:cuts[0] + 1] = "€".encode()  # the cut falls after the euro sign's first byte
    raw[cuts[1] - 2:cuts[1] + 2] = b"x\r\nx"  # ... between \r and \n
    raw[cuts[2] - 3:cuts[2] + 3] = b"inside"  # ... inside a word of a paragraph
    raw[-4:] = b"end\n"
    raw.decode("utf-8")
    (directory / "big.txt").write_bytes(bytes(raw))
    (directory / "small.txt").write_text("a small file\n\nwith two paragraphs\n", encoding="utf-8")
    return directory


def _prepared(tmp_path: Path, name: str, cfg, **fan_out):
    return prepare_dataset(cfg.replace(storage_root=str(tmp_path / name), **fan_out))


def _assert_same(one, other) -> None:
    assert one.fingerprint == other.fingerprint
    assert shard_files(one.manifest_url) == shard_files(other.manifest_url)
    assert comparable(storage.read_json(one.manifest_url)) == comparable(storage.read_json(other.manifest_url))


def test_text_shards_are_identical_for_any_fan_out_and_unit_size(tmp_path):
    cfg = config(tmp_path, dataset=str(_text_corpus(tmp_path / "corpus") / "*.txt"), block_size=64)
    one = _prepared(tmp_path, "one", cfg, prepare_tasks=1)
    sizes = {}
    for name, tasks, unit_mb in (("two", 2, 1), ("seven", 7, 1), ("whole", 3, 64)):
        other = _prepared(tmp_path, name, cfg, prepare_tasks=tasks, prepare_unit_mb=unit_mb)
        sizes[name] = storage.read_json(other.manifest_url)["prepare"]
        _assert_same(one, other)
    print(f"\nunits and lanes: {sizes}")
    assert sizes["two"] == {"units": 4, "lanes": 2} and sizes["seven"] == {"units": 4, "lanes": 4}
    assert sizes["whole"] == {"units": 1, "lanes": 1}


def test_json_lines_and_parquet_shards_are_identical_for_any_fan_out(tmp_path):
    import random

    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = random.Random(9)
    rows = [{"id": i, "body": _words(rng, rng.randint(5, 400)) + " é€"} for i in range(12_000)]
    jsonl, parquet = tmp_path / "jsonl", tmp_path / "parquet"
    jsonl.mkdir()
    parquet.mkdir()
    (jsonl / "rows.jsonl").write_text("\n".join(json.dumps(r, ensure_ascii=False) for r in rows) + "\n")
    pq.write_table(pa.table({"id": [r["id"] for r in rows], "body": [r["body"] for r in rows]}),
                   parquet / "rows.parquet", row_group_size=500)
    for corpus in (jsonl, parquet):
        cfg = config(tmp_path, dataset=str(corpus / "rows.*"), text_column="body", block_size=64)
        one = _prepared(tmp_path, f"{corpus.name}-one", cfg, prepare_tasks=1)
        many = _prepared(tmp_path, f"{corpus.name}-many", cfg, prepare_tasks=3, prepare_unit_mb=1)
        units = storage.read_json(many.manifest_url)["prepare"]["units"]
        assert units >= 3, units
        _assert_same(one, many)


LANE = """
import json, logging, sys
logging.basicConfig(level=logging.INFO, format="%(message)s")
from tasks.dataset.records import Unit, WorkPlan
from tasks.dataset.stage import tokenize_lane
tokenize_lane(WorkPlan.from_xcom(json.loads(sys.argv[1])), [Unit.from_xcom(u) for u in json.loads(sys.argv[2])])
"""


def test_a_lane_sigkilled_mid_unit_is_retried_and_gives_the_same_shards(tmp_path):
    cfg = config(tmp_path, dataset=str(_text_corpus(tmp_path / "corpus") / "*.txt"), block_size=64)
    one = _prepared(tmp_path, "one", cfg, prepare_tasks=1)
    fanned = cfg.replace(storage_root=str(tmp_path / "fanned"), prepare_tasks=2, prepare_unit_mb=1)
    planned = plan_dataset(fanned)
    plan, first = planned.work, planned.lanes[0]
    job = plan.job
    assert len(first) >= 2
    log_path = tmp_path / "lane.log"
    with open(log_path, "wb") as log_file:
        lane = subprocess.Popen([sys.executable, "-c", LANE, json.dumps(plan.to_xcom()),
                                 json.dumps([unit.to_xcom() for unit in first])], cwd=REPO, stdout=log_file,
                                stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 300
        while not Path(job.result_url(first[0].index)).exists():  # the first unit complete, the next under way
            assert lane.poll() is None and time.monotonic() < deadline, log_path.read_text()
            time.sleep(0.01)
    finally:
        lane.send_signal(signal.SIGKILL)
        lane.wait()
    with pytest.raises(PrepareError, match=r"Unit 1 of the dataset has no complete result .* Clear that task"):
        finish_dataset(plan, fanned)
    assert not list(Path(fanned.storage_root, "datasets").glob("*/manifest.json"))

    retried = run_planned(planned, fanned, started=time.perf_counter())  # every lane, the killed one again
    _assert_same(one, retried)
    assert not Path(job.work_url).exists(), "the work directory goes once the dataset is published"


def test_a_retry_keeps_the_units_that_were_complete(tmp_path, caplog):
    cfg = config(tmp_path, dataset=str(_text_corpus(tmp_path / "corpus") / "*.txt"), block_size=64,
                 prepare_tasks=2, prepare_unit_mb=1)
    planned = plan_dataset(cfg)
    from tasks.dataset.stage import tokenize_lane

    tokenize_lane(planned.work, planned.lanes[0])
    with caplog.at_level("INFO", logger="gpt_finetune.prepare"):
        tokenize_lane(planned.work, planned.lanes[0])
    kept = [r.getMessage() for r in caplog.records if "complete from an earlier try" in r.getMessage()]
    assert len(kept) == len(planned.lanes[0])


def test_a_unit_result_of_another_shape_is_refused_naming_the_file_and_field(tmp_path):
    """A unit's result file comes back from storage: one of this plan that is no `UnitResult` is refused by its
    field, by the lane's retry and by the finish alike; one of another plan is not this plan's (tokenized again)."""
    from tasks.dataset.stage import tokenize_lane

    cfg = config(tmp_path, dataset=str(_text_corpus(tmp_path / "corpus") / "*.txt"), block_size=64,
                 prepare_tasks=2, prepare_unit_mb=1)
    planned = plan_dataset(cfg)
    plan, lane = planned.work, planned.lanes[0]
    tokenize_lane(plan, lane)
    path = Path(plan.job.result_url(lane[0].index))
    genuine = json.loads(path.read_text())
    path.write_text(json.dumps({**genuine, "splits": {**genuine["splits"], "train": {
        **genuine["splits"]["train"], "tokens": str(genuine["splits"]["train"]["tokens"])}}}))
    refusal = (rf"The unit result {re.escape(str(path))} is refused: "
               r"UnitResult\.splits\.train: SplitStream\.tokens: expected int, got str")
    with pytest.raises(PrepareError, match=refusal):
        tokenize_lane(plan, lane)
    with pytest.raises(PrepareError, match=refusal):
        finish_dataset(plan, cfg)
    path.write_text(json.dumps({**genuine, "plan_id": "another plan"}))
    assert list(tokenize_lane(plan, lane).units) == [unit.index for unit in lane]
    assert json.loads(path.read_text())["plan_id"] == plan.job.plan_id


def test_a_source_that_changes_while_it_is_read_publishes_nothing(tmp_path):
    corpus = _text_corpus(tmp_path / "corpus")
    cfg = config(tmp_path, dataset=str(corpus / "*.txt"), block_size=64, prepare_tasks=2, prepare_unit_mb=1)
    planned = plan_dataset(cfg)
    with open(corpus / "big.txt", "ab") as grow:
        grow.write(b"\n\nappended while the stage ran\n")
    with pytest.raises(PrepareError, match=r"big.txt changed while the dataset was being prepared .* nothing was "
                                           r"published"):
        run_planned(planned, cfg, started=time.perf_counter())
    assert not list(Path(cfg.storage_root, "datasets").glob("*/manifest.json"))


def test_the_next_plan_of_the_same_dataset_removes_what_an_unfinished_one_left(tmp_path, monkeypatch):
    """Only what nothing wrote to for LEFTOVER_AGE_S: a younger plan may be another run's, still working."""
    from tasks.dataset import publish

    cfg = config(tmp_path, dataset=str(_text_corpus(tmp_path / "corpus") / "*.txt"), block_size=64,
                 prepare_tasks=2, prepare_unit_mb=1)
    earlier = plan_dataset(cfg).work.job
    assert Path(earlier.work_url).exists()
    beside = plan_dataset(cfg).work.job
    assert Path(earlier.work_url).exists() and Path(beside.work_url).exists()  # it may be live: kept
    monkeypatch.setattr(publish, "LEFTOVER_AGE_S", -1.0)  # both count as untouched for long now
    fresh = plan_dataset(cfg)
    assert not Path(earlier.work_url).exists() and not Path(beside.work_url).exists()
    assert Path(fresh.work.job.work_url).exists()


def test_two_preparations_of_one_fingerprint_never_destroy_each_other(tmp_path):
    """The review's finding 11: the second plan deleted the first one's units while its tasks ran, the first finish
    deleted the second's work, and a second publish replaced a dataset in use."""
    from tasks.dataset.stage import tokenize_lane

    cfg = config(tmp_path, dataset=str(_text_corpus(tmp_path / "corpus") / "*.txt"), block_size=64,
                 prepare_tasks=2, prepare_unit_mb=1)
    first, second = plan_dataset(cfg), plan_dataset(cfg)
    for planned in (first, second):
        for lane in planned.lanes:
            tokenize_lane(planned.work, lane)
    one = finish_dataset(first.work, cfg)
    assert not one.cache_hit and Path(second.work.job.work_url).exists()
    manifest = Path(one.manifest_url)
    published = (manifest.stat().st_ino, manifest.stat().st_mtime_ns)
    other = finish_dataset(second.work, cfg)
    assert other.cache_hit and other.manifest_url == one.manifest_url
    assert (manifest.stat().st_ino, manifest.stat().st_mtime_ns) == published  # not replaced: readers keep it
    assert not any(Path(p.work.job.work_url).exists() for p in (first, second))


def _sources(*sizes: int) -> Sources:
    return Sources("x", "text", tuple(SourceFile(f"/d/{i}.txt", size, "", f"{i}.txt") for i, size in enumerate(sizes)))


def test_units_cut_large_files_and_group_small_ones_in_source_order():
    units = plan_units(_sources(100, 100, 2500, 50), "text", 1000)
    assert [[(p.file, p.start, p.end) for p in u.parts] for u in units] == [
        [(0, 0, 100), (1, 0, 100)], [(2, 0, 833)], [(2, 833, 1666)], [(2, 1666, 2500), (3, 0, 50)]]
    assert [u.index for u in units] == [0, 1, 2, 3]


def test_lanes_are_contiguous_balanced_and_never_empty():
    units = [Unit(i, (Part(0, i, i + 1, size),)) for i, size in enumerate([10, 10, 10, 10, 100, 10, 10, 10])]
    dealt = lanes(units, 3)
    assert [[u.index for u in lane] for lane in dealt] == [[0, 1, 2, 3], [4], [5, 6, 7]]
    assert [[u.index for u in lane] for lane in lanes(units[:2], 5)] == [[0], [1]]


def test_task_count_and_unit_size_follow_the_corpus():
    assert task_count(0, 10 * MiB) == 1  # small: no mapped tasks
    assert task_count(0, 2048 * MiB) == 4 and task_count(0, 1 << 40) == 32
    assert task_count(5, 10 * MiB) == 5
    assert unit_size(0, 2048 * MiB, 4) == 128 * MiB  # a few units per task
    assert unit_size(0, 10 * MiB, 1) == 16 * MiB and unit_size(0, 1 << 40, 32) == 1 << 30  # at most 1024 units
    assert unit_size(3, 10 * MiB, 2) == 3 * MiB


def test_a_unit_inside_one_long_paragraph_holds_no_document_and_changes_nothing(tmp_path):
    from tasks.dataset.stage import tokenize_lane
    from tasks.dataset.units import unit_result

    corpus = tmp_path / "corpus"
    corpus.mkdir()
    long_paragraph = " ".join(WORDS * 25_000)  # ~3.5 MB without a blank line: whole 1 MiB units fall inside it
    short = "\n\n".join(f"paragraph {i} " + " ".join(WORDS) for i in range(2000))
    (corpus / "a.txt").write_text(short + "\n\n" + long_paragraph + "\n\n" + short + "\n", encoding="utf-8")
    cfg = config(tmp_path, dataset=str(corpus / "a.txt"), block_size=64)
    one = _prepared(tmp_path, "one", cfg, prepare_tasks=1)
    many = cfg.replace(storage_root=str(tmp_path / "many"), prepare_tasks=3, prepare_unit_mb=1)
    planned = plan_dataset(many)
    for lane in planned.lanes:
        tokenize_lane(planned.work, lane)
    documents = [unit_result(planned.work.job, u).documents for u in range(planned.work.units)]
    assert 0 in documents, documents
    _assert_same(one, finish_dataset(planned.work, many))
