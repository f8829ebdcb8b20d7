"""The prepare stage's three steps, as the DAG runs them, and `prepare_dataset`, which runs them in one process.

1. `plan_dataset` (one task, cheap checks first): resolve the sources, check the model's positions and the
   tokenizer, compute the fingerprint, return at once when a complete manifest with that fingerprint exists, check
   that `storage_root` is writable, remove what an unfinished run of this fingerprint left, train the BPE on its
   sample (or save the pretrained tokenizer) for the units, cut the corpus into units and deal them into lanes.
2. `run_lane` (`tasks.dataset.units`), one mapped task per lane: tokenize its units into their streams.
3. `finish_dataset` (one task): check that every unit is complete and no source changed, cut the streams into
   shards and publish them with `manifest.json` last, then remove the work directory.
With one lane (a small corpus, or `prepare_tasks` = 1) the first task runs all three itself, its units' streams in
a local temporary directory: no mapped task, no round trip through storage.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from core import storage
from core.clock import utc_now
from core.config import AccessPolicy, RunConfig
from core.layout import REPO_ROOT, StorageLayout
from tasks.dataset.checks import PLAN_FILE
from tasks.dataset.encode import joins_at_eos
from tasks.dataset.errors import PrepareError
from tasks.dataset.manifest import Manifest, ManifestTokenizer, PackingSettings, PrepareCounts
from tasks.dataset.plan import DatasetPlan, PreparedDataset
from tasks.dataset.publish import (
    TOKENIZER_DIR,
    check_writable,
    complete_manifest,
    dataset_fingerprint,
    file_entries,
    publish,
    remove_leftovers,
    work_url,
)
from tasks.dataset.records import LaneResult, TokenizerEntry, Unit, UnitJob, UnitResult, WorkPlan
from tasks.dataset.shards import split_streams, write_split
from tasks.dataset.sources import Sources, check_unchanged, resolve_sources
from tasks.dataset.split import SPLIT_RULE
from tasks.dataset.tokenizer import (
    EOS_TOKEN,
    TokenizerPlan,
    check_model,
    packing_backend,
    plan_tokenizer,
    save_tokenizer,
    train_bpe,
)
from tasks.dataset.units import (
    human_bytes,
    human_rate,
    lanes,
    load_tokenizer,
    plan_units,
    run_lane,
    task_count,
    unit_result,
    unit_size,
)
from trainer.data import FORMAT_VERSION

log = logging.getLogger("gpt_finetune.prepare")

RECORD_TARGET_BYTES = 64 << 10  # many sequences per record keeps TFRecord framing far below 1% of the bytes


@dataclass(frozen=True)
class DatasetIdentity:
    """Everything the fingerprint covers, resolved from a RunConfig without tokenizing anything."""

    sources: Sources
    tokenizer: TokenizerPlan
    settings: PackingSettings
    fingerprint: str


def identify_dataset(cfg: RunConfig, policy: AccessPolicy | None = None) -> DatasetIdentity:
    """Resolve sources (held to `policy`), check the model's positions and the tokenizer, compute the fingerprint."""
    sources = resolve_sources(cfg.dataset, REPO_ROOT, policy)
    check_model(cfg)
    plan = plan_tokenizer(cfg)
    settings = packing_settings(cfg, sources, plan)
    return DatasetIdentity(sources, plan, settings, dataset_fingerprint(sources, plan, settings))


def packing_settings(cfg: RunConfig, sources: Sources, plan: TokenizerPlan) -> PackingSettings:
    itemsize = np.dtype(plan.dtype).itemsize
    return PackingSettings(
        documents="paragraphs" if sources.kind == "text" else f"rows of {cfg.text_column!r}",
        text_column=cfg.text_column,
        val_fraction=cfg.val_fraction,
        split_rule=SPLIT_RULE,
        seed=cfg.seed,
        block_size=cfg.block_size,
        num_shards=cfg.effective_num_shards,
        max_validation_shards=cfg.num_workers,
        sequences_per_record=max(1, RECORD_TARGET_BYTES // (cfg.block_size * itemsize)),
        max_document_bytes=cfg.max_document_mb << 20,  # where long documents are cut (tasks/dataset/readers.py)
    )


@dataclass(frozen=True)
class Planned:
    """What `plan_dataset` returns to the process that planned: the plan (`work`: a `WorkPlan`, or the `Manifest`
    of the complete dataset for a cache hit), where it was saved for mapped tasks (`plan_url`, else None), its
    lanes and, for a caller that runs them itself (`run_planned`), the backend tokenizer already loaded."""

    fingerprint: str
    manifest_url: str
    work: WorkPlan | Manifest
    plan_url: str | None = None
    lanes: tuple[tuple[Unit, ...], ...] = ()
    tokenizer: Any = None

    def dataset_plan(self, cfg: RunConfig) -> DatasetPlan:
        """The dataset plan `prepare` hands on by XCom: the plan's ids and numbers, with the run's config."""
        work = self.work if isinstance(self.work, WorkPlan) else None
        return DatasetPlan(fingerprint=self.fingerprint, manifest_url=self.manifest_url, cache_hit=work is None,
                           config=cfg.to_dict(), plan_id=work.job.plan_id if work else None, plan_url=self.plan_url,
                           units=work.units if work else None, lanes=work.lanes if work else None)


# -- 1. plan ----------------------------------------------------------------------------------------------------


def plan_dataset(cfg: RunConfig, *, progress_interval_s: float = 5.0, started: float | None = None,
                 policy: AccessPolicy | None = None) -> Planned:
    """The plan, its lanes and the backend tokenizer (sources held to `policy`); the complete dataset's manifest
    instead on a cache hit. With more than one lane the plan is saved in its work directory (`plan.json`)."""
    started = time.perf_counter() if started is None else started
    layout = StorageLayout(cfg.storage_root)
    identity = identify_dataset(cfg, policy)
    sources, tokenizer_plan, fingerprint = identity.sources, identity.tokenizer, identity.fingerprint
    manifest_url = layout.manifest(fingerprint)
    log.info("dataset %s: %d %s file(s), %s; tokenizer %s; block_size %d; fingerprint %s", cfg.dataset,
             len(sources.files), sources.kind, human_bytes(sources.total_bytes), cfg.tokenizer, cfg.block_size,
             fingerprint)
    cached = complete_manifest(manifest_url, fingerprint)
    if cached is not None:
        log.info("cache hit: %s is complete, reusing it without tokenizing", manifest_url)
        return Planned(fingerprint, manifest_url, cached)

    if not sources.total_bytes:
        raise PrepareError(f"Dataset {cfg.dataset!r} has no documents: {sources.names()} are empty.")
    check_writable(cfg.storage_root)
    tasks = task_count(cfg.prepare_tasks, sources.total_bytes)
    remove_leftovers(leftovers := work_url(layout, fingerprint))
    plan_id = uuid.uuid4().hex[:12]
    # One lane runs here, its streams in a local directory; lanes for mapped tasks share storage.
    work = _temporary_work(fingerprint) if tasks == 1 else storage.join(leftovers, plan_id)
    tokenizer = tokenizer_plan.pretrained or train_bpe(sources, cfg, tokenizer_plan.sample, progress_interval_s)
    tokenizer_dir = storage.join(work, TOKENIZER_DIR)
    _save(tokenizer, tokenizer_dir)
    backend = packing_backend(tokenizer.backend_tokenizer)  # what was saved: the lanes load the same from there
    units = plan_units(sources, cfg.text_column, unit_size(cfg.prepare_unit_mb, sources.total_bytes, tasks))
    dealt = tuple(tuple(lane) for lane in lanes(units, tasks))
    job = UnitJob(plan_id=plan_id, work_url=work, tokenizer_dir=tokenizer_dir, kind=sources.kind,
                  text_column=cfg.text_column, seed=cfg.seed, val_fraction=cfg.val_fraction,
                  dtype=tokenizer_plan.dtype, eos_token=tokenizer.eos_token, eos_id=tokenizer.eos_token_id,
                  joined=joins_at_eos(backend, tokenizer.eos_token), sources=sources.files,
                  max_document_bytes=cfg.max_document_mb << 20)
    log.info("%d unit(s) of about %s in %d lane(s)%s%s", len(units),
             human_bytes(sources.total_bytes / max(len(units), 1)),
             len(dealt), "" if len(dealt) == 1 else " (one mapped task each)",
             "" if job.joined else "; one document per tokenizer input (joining them at the EOS would change the ids)")
    plan = WorkPlan(fingerprint=fingerprint, manifest_url=manifest_url, job=job, units=len(units), lanes=len(dealt),
                    settings=identity.settings,
                    tokenizer=TokenizerEntry(spec=tokenizer_plan.spec, fingerprint=tokenizer_plan.fingerprint,
                                             vocab_size=len(tokenizer), eos_token_id=tokenizer.eos_token_id),
                    temporary_work=tasks == 1, plan_s=round(time.perf_counter() - started, 3))
    plan_url = None
    if tasks > 1:  # the tasks read the plan from storage: XCom carries its ids, not its list of files
        plan_url = storage.join(work, PLAN_FILE)
        storage.write_json_atomic(plan_url, plan.to_xcom())
    return Planned(fingerprint, manifest_url, plan, plan_url, dealt, backend)


def _temporary_work(fingerprint: str) -> str:
    """A local work directory for a one-lane plan, named after this process: those of the same dataset left by a
    process that died (a SIGKILLed task) are removed here; a live one's (another run of it) stay."""
    for stale in Path(tempfile.gettempdir()).glob(f"prepare-{fingerprint}-*-*"):
        pid = stale.name.removeprefix(f"prepare-{fingerprint}-").split("-", 1)[0]
        if pid.isdigit() and not storage.pid_alive(int(pid)):
            log.info("removing %s left by an interrupted run", stale)
            shutil.rmtree(stale, ignore_errors=True)
    return tempfile.mkdtemp(prefix=f"prepare-{fingerprint}-{os.getpid()}-")


def _save(tokenizer: Any, url: str) -> None:
    with storage.staging_directory(url) as stage:
        save_tokenizer(tokenizer, stage)
        storage.publish_directory(stage, url)


# -- 2. lanes ---------------------------------------------------------------------------------------------------


def tokenize_lane(plan: WorkPlan, lane: Sequence[Unit], progress_interval_s: float = 5.0) -> LaneResult:
    """One mapped task: the lane's units (a small summary goes to XCom; the results are in storage). In a DAG run
    the plan and the lane are the checked ones (tasks/dataset/checks.py)."""
    results = run_lane(plan.job, list(lane), stage_bytes=_planned_bytes(plan), progress_interval_s=progress_interval_s)
    return LaneResult(units=tuple(r.unit for r in results), tokens=sum(r.tokens for r in results),
                      wall_s=round(sum(r.wall_s for r in results), 3))


def _planned_bytes(plan: WorkPlan) -> int:
    return sum(source.size for source in plan.job.sources)


# -- 3. finish --------------------------------------------------------------------------------------------------


def finish_dataset(plan: WorkPlan, cfg: RunConfig, *, started: float | None = None) -> PreparedDataset:
    """Shards and manifest from the units' streams, published manifest last (or the dataset another preparation of
    the same fingerprint published meanwhile). In a DAG run `plan` is the checked one and `cfg` held to the policy."""
    started = time.perf_counter() if started is None else started
    job = plan.job
    for source in job.sources:
        check_unchanged(source)
    results = [_complete(job, unit) for unit in range(plan.units)]
    read = sum(r.fetched_bytes for r in results)
    began = time.perf_counter()
    layout = StorageLayout(cfg.storage_root)
    published = _published_meanwhile(plan)
    if published is not None:  # another run prepared the same dataset first: it stays as it is, in use or not
        _remove_own_work(plan, layout)
        return _result(plan.manifest_url, published, cache_hit=True, tokenized=0, started=started, timings={},
                       read=read)
    with storage.staging_directory(layout.dataset(plan.fingerprint)) as stage:
        manifest, tokens = _build(plan, cfg, results, stage)
        shards_s = time.perf_counter() - began
        if _published_meanwhile(plan) is None:
            publish(stage, layout.dataset(plan.fingerprint), manifest)
    _remove_own_work(plan, layout)
    timings = {"plan": plan.plan_s, "units": max((r.wall_s for r in results), default=0.0),
               "shards": round(shards_s, 3), "manifest": round(time.perf_counter() - began - shards_s, 3)}
    size = sum(s.size for s in job.sources)
    log.info("published %s: %d train / %d validation sequences (plan %.1fs, longest unit %.1fs, shards %.1fs, "
             "publishing %.1fs); the units read %s from storage for %s of sources (%.3fx)", plan.manifest_url,
             manifest.splits["train"].sequences, manifest.splits["validation"].sequences,
             timings["plan"], timings["units"], timings["shards"], timings["manifest"], human_bytes(read),
             human_bytes(size), read / max(size, 1))
    return _result(plan.manifest_url, manifest, cache_hit=False, tokenized=tokens, started=started,
                   timings=timings, read=read)


def _published_meanwhile(plan: WorkPlan) -> Manifest | None:
    """The complete manifest of this fingerprint when another preparation published it after this one planned:
    publishing again would first delete a dataset that training runs may be reading."""
    manifest = complete_manifest(plan.manifest_url, plan.fingerprint)
    if manifest is not None:
        log.info("%s was published meanwhile by another preparation of the same dataset: using it, publishing "
                 "nothing", plan.manifest_url)
    return manifest


def _remove_own_work(plan: WorkPlan, layout: StorageLayout) -> None:
    """This plan's work directory only: another plan of the same fingerprint may be running beside it."""
    storage.remove_tree(plan.job.work_url)
    if not plan.temporary_work:  # kept while another plan's directory is still there
        storage.remove_empty_directory(work_url(layout, plan.fingerprint))


def _complete(job: UnitJob, unit: int) -> UnitResult:
    result = unit_result(job, unit)
    if result is None:
        raise PrepareError(f"Unit {unit} of the dataset has no complete result in {job.work_url}: its tokenize task "
                           "did not finish. Clear that task (its retry redoes only its missing units).")
    return result


def _build(plan: WorkPlan, cfg: RunConfig, results: list[UnitResult], stage: Path) -> tuple[Manifest, int]:
    job = plan.job
    documents = sum(r.documents for r in results)
    tokens = sum(r.tokens for r in results)
    names = ", ".join(s.url for s in job.sources[:3]) + (f" and {len(job.sources) - 3} more"
                                                           if len(job.sources) > 3 else "")
    if documents == 0:
        raise PrepareError(f"Dataset {cfg.dataset!r} has no documents: {names} are empty.")
    if documents < 2:
        raise PrepareError(
            f"Dataset {cfg.dataset!r} has a single document, but the validation split needs one of its own: "
            "add data, or separate documents by blank lines in .txt files.")
    if tokens == documents:  # nothing but the EOS after every document
        raise PrepareError(f"Dataset {cfg.dataset!r} contains no text: {names} yield no tokens.")
    streams, counts = split_streams(results, job.stream_url, job.dtype)
    block, per_record = cfg.block_size, plan.settings.sequences_per_record
    train_sequences, validation_sequences = streams["train"].tokens // block, streams["validation"].tokens // block
    if train_sequences < cfg.effective_num_shards:
        raise PrepareError(
            f"Dataset {cfg.dataset!r} gives {train_sequences} training sequences of {block} tokens, fewer than the "
            f"{cfg.effective_num_shards} shards to write: add data, lower 'block_size' or 'num_shards'.")
    if validation_sequences == 0:
        raise PrepareError(
            f"Dataset {cfg.dataset!r}: the validation split (val_fraction={cfg.val_fraction}) has fewer than "
            f"{block} tokens: raise 'val_fraction' or lower 'block_size'.")
    log.info("%d documents: %d for training, %d for validation; writing shards", documents, counts["train"],
             counts["validation"])
    _copy_tokenizer(job.tokenizer_dir, stage / TOKENIZER_DIR)
    validation_shards = min(plan.settings.max_validation_shards, validation_sequences)
    splits = {
        "train": write_split(streams["train"], "train", cfg.effective_num_shards, block, per_record, stage,
                             documents=counts["train"]),
        "validation": write_split(streams["validation"], "validation", validation_shards, block, per_record, stage,
                                  documents=counts["validation"]),
    }
    tokenizer = plan.tokenizer
    manifest = Manifest(
        format_version=FORMAT_VERSION, fingerprint=plan.fingerprint, created_at=utc_now(), dtype=job.dtype,
        block_size=block, sequences_per_record=per_record,
        tokenizer=ManifestTokenizer(spec=tokenizer.spec, fingerprint=tokenizer.fingerprint,
                                    vocab_size=tokenizer.vocab_size, eos_token_id=tokenizer.eos_token_id,
                                    path=TOKENIZER_DIR, files=file_entries(stage / TOKENIZER_DIR)),
        sources=job.sources, settings=plan.settings, splits=splits,
        prepare=PrepareCounts(units=plan.units, lanes=plan.lanes))
    return manifest, tokens


def _copy_tokenizer(url: str, target: Path) -> None:
    if not storage.download_tree(url, target):
        raise PrepareError(f"The tokenizer directory {url} is empty or missing: the plan saved it there and the "
                           "lanes read it. Run the dataset's preparation again from its first task.")


# -- all three in one process -----------------------------------------------------------------------------------


def prepare_dataset(cfg: RunConfig, *, progress_interval_s: float = 5.0, started: float | None = None) -> \
        PreparedDataset:
    """Tokenize `cfg.dataset` into shards + manifest under `cfg.storage_root`, or reuse a complete earlier result,
    running every lane here one after the other (the same units, streams and shards as mapped tasks would).

    `started` is the `time.perf_counter()` at which the calling task began (default: this call), so that the rate
    logged counts the stage's start-up too. Raises `PrepareError` naming the file, key or setting at fault; on any
    failure no manifest is published."""
    started = time.perf_counter() if started is None else started
    planned = plan_dataset(cfg, progress_interval_s=progress_interval_s, started=started)
    return run_planned(planned, cfg, progress_interval_s=progress_interval_s, started=started)


def run_planned(planned: Planned, cfg: RunConfig, *, progress_interval_s: float = 5.0,
                started: float) -> PreparedDataset:
    """Every lane of a plan in this process, then the finish (a cache hit: the complete dataset)."""
    plan = planned.work
    if isinstance(plan, Manifest):
        return _result(planned.manifest_url, plan, cache_hit=True, tokenized=0, started=started, timings={}, read=0)
    began, cpu_began = time.perf_counter(), time.process_time()
    try:
        tokenizer = planned.tokenizer or load_tokenizer(plan.job.tokenizer_dir)
        for lane in planned.lanes:
            run_lane(plan.job, list(lane), tokenizer, stage_bytes=_planned_bytes(plan),
                     progress_interval_s=progress_interval_s)
        tokenizing_s, cpu_s = time.perf_counter() - began, time.process_time() - cpu_began
        result = finish_dataset(plan, cfg, started=started)
    finally:
        if plan.temporary_work:  # a failed stage leaves nothing behind; in storage, a retry reuses its units
            shutil.rmtree(plan.job.work_url, ignore_errors=True)
    elapsed, start_up = time.perf_counter() - started, began - started
    cores = len(os.sched_getaffinity(0))
    log.info(
        "prepare: %d tokens in %.2fs = %s tokens/s end to end on %d core(s): start-up %.2fs (imports, tokenizer, "
        "plan), tokenizing %.2fs at %s tokens/s with %.1f cores busy, shards and publishing %.2fs; end to end "
        "ran at %.2fx the tokenizing rate", result.tokenized_tokens, elapsed,
        human_rate(result.tokenized_tokens / elapsed), cores, start_up, tokenizing_s,
        human_rate(result.tokenized_tokens / max(tokenizing_s, 1e-9)), cpu_s / max(tokenizing_s, 1e-9),
        elapsed - start_up - tokenizing_s, tokenizing_s / elapsed)
    return result


def _result(manifest_url: str, manifest: Manifest, *, cache_hit: bool, tokenized: int, started: float,
            timings: dict[str, float], read: int) -> PreparedDataset:
    train = manifest.splits["train"]
    return PreparedDataset(
        manifest_url=manifest_url,
        fingerprint=manifest.fingerprint,
        cache_hit=cache_hit,
        train_sequences=train.sequences,
        validation_sequences=manifest.splits["validation"].sequences,
        train_tokens=train.tokens,
        tokenized_tokens=tokenized,
        elapsed_s=time.perf_counter() - started,
        timings=timings,
        source_bytes_read=read,
    )


__all__ = ["EOS_TOKEN", "PrepareError", "PreparedDataset", "finish_dataset", "plan_dataset", "prepare_dataset",
           "tokenize_lane"]
