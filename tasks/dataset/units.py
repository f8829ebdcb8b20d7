"""Work units and lanes: the corpus cut into pieces any task can tokenize alone, and those pieces dealt out to tasks.

A unit is a list of parts, each a byte range of a text or JSON Lines file or a row-group range of a Parquet file,
in source order: a large file is cut into ranges of about the unit size, small files are grouped whole. A unit
writes one token stream per split (`<unit>.train.bin`, `<unit>.validation.bin`) and then its result
(`<unit>.json`: counts, the extreme documents, checksums), the mark that it is complete; a retried task skips the
units it already completed and overwrites only its own. The units' streams, in unit order, are the stage's streams
whatever the units are (`tasks.dataset.shards`). A lane is the contiguous run of units one mapped task tokenizes;
there are `prepare_tasks` lanes, so at most that many tasks run at once. The units, their job and their results are
documents (`tasks.dataset.records`).
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from core import storage
from core.document import DocumentError
from tasks.dataset.encode import SPLITS, Encoder, EncodeStats
from tasks.dataset.errors import PrepareError, SourceError
from tasks.dataset.ranges import DocumentChunk, SourceReader
from tasks.dataset.readers import parquet_layout, read_documents
from tasks.dataset.records import Part, SplitStream, Unit, UnitJob, UnitResult
from tasks.dataset.sources import SourceFile, Sources, check_unchanged
from tasks.dataset.split import DocumentDraws
from tasks.dataset.tokenizer import load_backend

log = logging.getLogger("gpt_finetune.prepare")

MAX_UNITS = 1024  # Airflow's [core] max_map_length; lanes hold several units each
AUTO_UNITS_PER_LANE = 4  # work in smaller pieces than tasks: progress, retries and the last task's tail
MIN_AUTO_UNIT_BYTES = 16 << 20
MAX_AUTO_UNIT_BYTES = 256 << 20
AUTO_BYTES_PER_TASK = 512 << 20  # prepare_tasks=0: one task per this much text, from FAN_OUT_FROM on
FAN_OUT_FROM = 256 << 20  # below this a corpus is prepared inside the first task, without mapped tasks
MAX_AUTO_TASKS = 32


def task_count(prepare_tasks: int, total_bytes: int) -> int:
    """Lanes for a corpus: `prepare_tasks`, or with 0 one per AUTO_BYTES_PER_TASK once it is large enough to gain."""
    if prepare_tasks:
        return prepare_tasks
    if total_bytes < FAN_OUT_FROM:
        return 1
    return min(MAX_AUTO_TASKS, math.ceil(total_bytes / AUTO_BYTES_PER_TASK))


def unit_size(unit_mb: int, total_bytes: int, tasks: int) -> int:
    """Bytes per unit: `prepare_unit_mb`, or a few units per task within [16 MiB, 256 MiB], at most MAX_UNITS."""
    if unit_mb:
        return max(unit_mb << 20, math.ceil(total_bytes / MAX_UNITS))
    wanted = math.ceil(total_bytes / (tasks * AUTO_UNITS_PER_LANE))
    return max(min(max(wanted, MIN_AUTO_UNIT_BYTES), MAX_AUTO_UNIT_BYTES), math.ceil(total_bytes / MAX_UNITS))


def plan_units(sources: Sources, text_column: str, size: int) -> list[Unit]:
    """Units of about `size` bytes in source order (Parquet cut at row groups, read from each file's footer)."""
    units: list[Unit] = []
    current: list[Part] = []
    filled = 0

    def close() -> None:
        nonlocal current, filled
        if current:
            units.append(Unit(len(units), tuple(current)))
        current, filled = [], 0

    for index, source in enumerate(sources.files):
        for part in _file_parts(index, source, sources.kind, text_column, size):
            if filled and filled + part.bytes > size:
                close()
            current.append(part)
            filled += part.bytes
            if filled >= size:
                close()
    close()
    return units


def _file_parts(index: int, source: SourceFile, kind: str, text_column: str, size: int) -> Iterator[Part]:
    if kind == "parquet":
        with SourceReader(source) as reader:
            groups = parquet_layout(reader, text_column)
        start, filled = 0, 0
        for group, layout in enumerate(groups):
            filled += layout["bytes"]
            if filled >= size or group == len(groups) - 1:
                yield Part(index, start, group + 1, filled)
                start, filled = group + 1, 0
        return
    if kind == "jsonl" and source.size:
        with SourceReader(source) as reader:
            if reader.read_at(0, 4096).lstrip()[:1] == b"[":
                raise SourceError(f"Source file {source.url} is a JSON array, not JSON Lines: convert it with "
                                  f"`jq -c '.[]' {Path(source.url).name} > out.jsonl`.")
    pieces = max(1, math.ceil(source.size / size))
    for piece in range(pieces):
        start, end = piece * source.size // pieces, (piece + 1) * source.size // pieces
        yield Part(index, start, end, end - start)


def lanes(units: list[Unit], tasks: int) -> list[list[Unit]]:
    """Contiguous runs of units, one per task, balanced by bytes (a unit goes to the lane its middle byte falls
    in); a lane that would stay empty is dropped."""
    total = sum(unit.bytes for unit in units) or 1
    count = max(1, min(tasks, len(units)))
    out: list[list[Unit]] = [[] for _ in range(count)]
    done = 0
    for unit in units:
        out[min(count - 1, int((done + unit.bytes / 2) * count / total))].append(unit)
        done += unit.bytes
    return [lane for lane in out if lane]


# -- tokenizing a unit ------------------------------------------------------------------------------------------


def unit_result(job: UnitJob, unit: int) -> UnitResult | None:
    """A unit's result when it is complete for this plan: its result file and both streams at their sizes. A result
    file of this plan that is no `UnitResult` is refused, naming the file and the field."""
    url = job.result_url(unit)
    try:
        written = storage.read_json(url)
    except (FileNotFoundError, NotADirectoryError, ValueError):
        return None
    if not isinstance(written, dict) or written.get("plan_id") != job.plan_id:
        return None  # another plan's, or cut short: the unit is tokenized again
    try:
        result = UnitResult.from_xcom(written)
    except DocumentError as error:
        raise PrepareError(f"The unit result {url} is refused: {error} It was not written by this plan's tokenize "
                           "task: remove it and clear that task, which tokenizes the unit again.") from None
    fs, _ = storage.filesystem(job.work_url)
    for split in SPLITS:
        _, path = storage.filesystem(job.stream_url(unit, split))
        try:
            if fs.size(path) != result.splits[split].bytes:
                return None
        except FileNotFoundError:
            return None
    return result


def run_lane(job: UnitJob, lane: list[Unit], tokenizer=None, *, stage_bytes: int | None = None,
             progress_interval_s: float = 5.0) -> list[UnitResult]:
    """Tokenize every unit of `lane` not complete yet; returns their results. `tokenizer`: the backend tokenizer
    when the caller has it loaded, else it is loaded from the job's tokenizer directory."""
    tokenizer = tokenizer or load_tokenizer(job.tokenizer_dir)
    total = sum(unit.bytes for unit in lane)
    log.info("tokenizing %d unit(s), %s of text, on %d core(s)", len(lane), human_bytes(total),
             len(os.sched_getaffinity(0)))
    progress = _Progress(total, len(lane), stage_bytes, progress_interval_s)
    results = []
    for position, unit in enumerate(lane):
        done = unit_result(job, unit.index)
        if done is not None:
            log.info("unit %d is complete from an earlier try: kept", unit.index)
            progress.skip(unit.bytes)
        else:
            progress.start_unit(position, unit)
            done = tokenize_unit(job, unit, tokenizer, progress)
        results.append(done)
    progress.finish()
    return results


def tokenize_unit(job: UnitJob, unit: Unit, tokenizer, progress: _Progress) -> UnitResult:
    """Encode one unit into its streams (staged locally, then published next to its result, result last)."""
    began = time.perf_counter()
    chunks = _UnitChunks(job, unit)
    # Staged beside the unit's result when the work directory is local (publishing is then a rename), else in the
    # host's temporary directory (a unit's streams, about half its text's size, are all it needs).
    with storage.staging_directory(job.result_url(unit.index)) as scratch:
        paths = {split: Path(scratch) / f"{split}.bin" for split in SPLITS}
        with contextlib.ExitStack() as files:
            outputs = {split: files.enter_context(open(path, "wb")) for split, path in paths.items()}
            encoder = Encoder(tokenizer, job.eos_token, job.eos_id, np.dtype(job.dtype), job.joined,
                              job.val_fraction, outputs)
            stats: EncodeStats = encoder.run(chunks, progress.advance)
        splits, hashing = {}, 0.0
        for split, path in paths.items():
            count = stats.splits[split]
            began_hashing = time.thread_time()  # CPU seconds, as the other steps, of the sha256 alone
            sha256 = storage.sha256_file(path)
            hashing += time.thread_time() - began_hashing
            splits[split] = SplitStream(documents=count.documents, tokens=count.tokens, bytes=path.stat().st_size,
                                        sha256=sha256, extreme=count.extreme)
            storage.publish_file(path, job.stream_url(unit.index, split))
        stats.steps["hashing"] = hashing
    result = UnitResult(plan_id=job.plan_id, unit=unit.index, splits=splits, bytes=unit.bytes,
                        fetched_bytes=chunks.fetched, wall_s=round(time.perf_counter() - began, 3),
                        cpu_s=round(stats.cpu_s, 3))
    storage.write_json_atomic(job.result_url(unit.index), result.to_xcom())  # last: the unit is complete
    progress.end_unit(unit, result, stats.steps)
    return result


class _UnitChunks:
    """The unit's chunks, part after part, each with its file's draws, counting the bytes fetched from storage.
    Each file must be as the plan saw it before and after its part is read."""

    def __init__(self, job: UnitJob, unit: Unit) -> None:
        self.job, self.unit, self.fetched = job, unit, 0

    def __iter__(self) -> Iterator[tuple[DocumentChunk, DocumentDraws]]:
        job = self.job
        for part in self.unit.parts:
            source = job.sources[part.file]
            check_unchanged(source)
            draws = DocumentDraws(job.seed, source.relpath)
            with SourceReader(source) as reader:
                for chunk in read_documents(reader, job.kind, part.start, part.end, job.text_column,
                                            job.max_document_bytes):
                    yield chunk, draws
                self.fetched += reader.fetched
            check_unchanged(source)


def load_tokenizer(directory: str):
    """The backend tokenizer saved in `directory` (local or in storage)."""
    with tempfile.TemporaryDirectory(prefix="tokenizer-") as scratch:
        return load_backend(storage.local_copy(storage.join(directory, "tokenizer.json"), scratch).parent)


class _Progress:
    """Logs documents, tokens, tokens/s and ETA of a lane (and of each unit) at most every `interval_s` seconds."""

    def __init__(self, total_bytes: int, units: int, stage_bytes: int | None, interval_s: float) -> None:
        self.total_bytes, self.units, self.interval_s = total_bytes, units, interval_s
        self.done_bytes = self.documents = self.tokens = 0
        self.started = self.last = time.perf_counter()
        self._unit_base: tuple[int, int, int] = (0, 0, 0)
        self._current: tuple[int, Unit] | None = None
        if stage_bytes and stage_bytes > total_bytes:
            log.info("this task tokenizes %d unit(s), %s of the stage's %s", units, human_bytes(total_bytes),
                     human_bytes(stage_bytes))

    def skip(self, nbytes: int) -> None:
        self.done_bytes += nbytes

    def start_unit(self, position: int, unit: Unit) -> None:
        self._current = (position, unit)
        self._unit_base = (self.done_bytes, self.documents, self.tokens)

    def advance(self, stats: EncodeStats) -> None:
        base_bytes, base_docs, base_tokens = self._unit_base
        self.documents, self.tokens = base_docs + stats.documents, base_tokens + stats.tokens
        self.done_bytes = base_bytes + min(stats.consumed, self._current[1].bytes if self._current else 0)
        now = time.perf_counter()
        if now - self.last >= self.interval_s:
            self.last = now
            self._log(now)

    def end_unit(self, unit: Unit, result: UnitResult, steps: dict[str, float]) -> None:
        """The unit's line, with the seconds of each step (the record's `steps`, which the benchmark reads)."""
        base_bytes, base_docs, base_tokens = self._unit_base
        self.done_bytes = base_bytes + unit.bytes
        self.documents = base_docs + result.documents
        self.tokens = base_tokens + result.tokens
        log.info("unit %d: %d documents, %d tokens in %.1fs (%s tokens/s), %s read for %s of text; steps: %s",
                 unit.index, result.documents, result.tokens, result.wall_s,
                 human_rate(result.tokens / max(result.wall_s, 1e-9)), human_bytes(result.fetched_bytes),
                 human_bytes(unit.bytes),
                 ", ".join(f"{step} {seconds:.2f}s" for step, seconds in steps.items()), extra={"steps": steps})

    def finish(self) -> None:
        self._log(time.perf_counter())

    def _log(self, now: float) -> None:
        elapsed = max(now - self.started, 1e-9)
        done = min(1.0, self.done_bytes / self.total_bytes) if self.total_bytes else 1.0
        eta = elapsed * (1 - done) / done if done > 0 else float("inf")
        unit = f"unit {self._current[0] + 1}/{self.units}" if self._current else f"{self.units} unit(s)"
        log.info("tokenized %d documents (%s, %.0f%% of %s), %d tokens, %s tokens/s, ETA %.0fs", self.documents,
                 unit, 100 * done, human_bytes(self.total_bytes), self.tokens, human_rate(self.tokens / elapsed), eta)


def human_bytes(count: float) -> str:
    return f"{count / 2**20:.1f} MB" if count >= 2**20 else f"{count / 2**10:.1f} KB"


def human_rate(rate: float) -> str:
    return f"{rate / 1e6:.2f}M" if rate >= 1e6 else f"{rate / 1e3:.1f}k"


