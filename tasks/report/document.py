"""report.json as a typed document: the evaluate task builds a `RunReport` (tasks/report/comparison.py,
tasks/evaluate.py) and writes `to_json()`; promote and later runs' history read one back with `RunReport.from_json`.

report.json comes back from storage, which whoever may write the run's storage could edit, and earlier runs wrote
it with fewer fields: reading checks the type of every field modelled here and refuses a missing required or a
mistyped one with a ReportError naming the file and the field (its path, e.g. `runs.distributed.eval_loss`):
core/document.py's reader, the one every document uses.
Fields added after the first reports default to what those reports meant (absent: unknown, none). Keys a record
does not model stay in its `extra` and are written back as they were, so a report read and written again keeps
its keys and values. A number field takes an int as it is (the JSON keeps `3`, not `3.0`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, Self

from core.document import DocumentError, OpenDocument
from core.summary import MemoryFigures
from tasks.report.formatting import fmt, known_words


class ReportError(DocumentError):
    """A report.json (or a part of it) that is not one: not an object, or a missing or mistyped field. The message
    names the file, the field and the value; `brief` only the field and what is wrong (for pages that show neither
    storage URLs nor what a storage writer put there)."""

    def __init__(self, source: str, path: str, problem: str, shown: str = "") -> None:
        where = ": ".join(part for part in (source, path) if part)
        super().__init__(f"{where}: {problem}{shown}.", source=source, path=path, problem=problem, shown=shown)


@dataclasses.dataclass(frozen=True)
class Record(OpenDocument):
    """Base of report.json's records (core/document.py's reader): `extra` holds the keys this version does not
    model, written back as read."""

    @classmethod
    def from_json(cls, value: Any, source: str, path: str = "") -> Self:
        """The record `value` (read from `source`, at `path` in it) holds; ReportError naming both otherwise."""
        try:
            return super().from_json(value, source, path)
        except DocumentError as error:
            raise ReportError(source, error.path or "the report", error.problem, error.shown) from None


@dataclasses.dataclass(frozen=True)
class EvalSample(Record):
    """What an evaluation scored (trainer/eval_sample.py); every field None when the result did not say.

    Attributes:
        id: the sample's identity (the same for every model and run on this dataset and `eval_tokens`).
        tokens, sequences: the sample's size; split_tokens, split_sequences: the validation split's.
        whole_split: the sample is the whole split (no sampling error); asked_tokens: the setting `eval_tokens`.
        workers: the workers that scored it; read_bytes: the shard bytes they read.
    """

    id: str | None = None
    tokens: int | None = None
    split_tokens: int | None = None
    sequences: int | None = None
    split_sequences: int | None = None
    whole_split: bool | None = None
    asked_tokens: int | None = None
    workers: int | None = None
    read_bytes: int | None = None

    @classmethod
    def of(cls, sample: Any) -> EvalSample | None:
        """The figures of an evaluation result's `sample` (its per-sequence losses stay in the result)."""
        if not isinstance(sample, Mapping):
            return None
        return cls(**{field.name: sample.get(field.name) for field in dataclasses.fields(cls) if field.name != "extra"})


@dataclasses.dataclass(frozen=True)
class RunFigures(Record):
    """One trained model's figures (report.json `runs.distributed`, `runs.baseline`; tasks/report/comparison.py).

    Attributes:
        label: "distributed" or "baseline"; num_workers, global_batch_size, steps, tokens_seen: its training.
        train_time_s, wall_time_s, tokens_per_s, final_loss, mfu, seconds_per_step: from its summary.json (None:
            not timed, no loss logged, no known peak).
        eval_loss, perplexity, eval_tokens, eval_time_s: its evaluation; eval_loss_se: the loss's standard error
            over the sample's sequences (0 for the whole split); nats_per_char, known_words (KNOWN in
            tasks/report/store.py): None in reports of evaluations that predate them; eval_sample: what it was scored
            on.
        output_url, model_url, summary_url: its training output, model and summary.
        started_at, finished_at: UTC timestamps; resumed_from_step: the checkpoint it resumed from.
        gpu_mem_peak_mb, gpu_mem_reserved_mb: rank 0's GPU memory (None on CPU).
        memory: rank 0's memory forecast beside its measured peak (None in reports before it).
        hardware, versions, allreduce: its summary's (where, with what, how the gradients crossed the network).
        release_after_train_s: seconds from its group's exit to the proof its slots were free (None: not proven,
            or not trained by this run).
    """

    label: str
    num_workers: int
    global_batch_size: int
    steps: int
    tokens_seen: int
    train_time_s: float
    wall_time_s: float
    tokens_per_s: float | None
    final_loss: float | None
    eval_loss: float
    perplexity: float
    eval_tokens: int
    eval_time_s: float
    output_url: str
    model_url: str
    summary_url: str
    seconds_per_step: float | None = None
    mfu: float | None = None
    gpu_mem_peak_mb: float | None = None
    gpu_mem_reserved_mb: float | None = None
    memory: MemoryFigures | None = None
    nats_per_char: float | None = None
    known_words: dict[str, Any] | None = None
    eval_loss_se: float | None = None
    eval_sample: EvalSample | None = None
    started_at: str | None = None
    finished_at: str | None = None
    resumed_from_step: int | None = None
    hardware: dict[str, Any] | None = None
    versions: dict[str, Any] | None = None
    allreduce: dict[str, Any] | None = None
    release_after_train_s: float | None = None


@dataclasses.dataclass(frozen=True)
class Runs(Record):
    """report.json `runs`: the distributed model's figures and the baseline's (None: baseline skipped)."""

    distributed: RunFigures
    baseline: RunFigures | None

    def trained(self) -> list[RunFigures]:
        """The models trained, the baseline (the 1-worker reference) first."""
        return [run for run in (self.baseline, self.distributed) if run is not None]


@dataclasses.dataclass(frozen=True)
class Comparison(Record):
    """speedup = T1/TN, efficiency = speedup/N, loss_delta = lossN - loss1 (None without a baseline or timing);
    loss_delta_se: the delta's standard error, paired over the sample's sequences; loss_tolerance: the setting."""

    speedup: float | None
    efficiency: float | None
    loss_delta: float | None
    loss_tolerance: float
    loss_delta_se: float | None = None


@dataclasses.dataclass(frozen=True)
class Gate(Record):
    """One gate: `name`, whether it `passed`, its `value` and `limit` (None: not a figure) and a sentence with the
    numbers (`detail`, the failure message's)."""

    name: str
    passed: bool
    value: float | None
    limit: float | None
    detail: str


@dataclasses.dataclass(frozen=True)
class ExportPart(Record):
    """What promote records of the serving exports in promotion.json (beside its verdict; tasks/exports.py builds it).

    Attributes:
        export_gates: one gate per format of `export_formats` (`export_<format>`): passed when its parity check
            passed; the view counts them with the report's (tasks/report/parts.py `with_exports`).
        exports: the training output's parity record (`exports/exports.json`, trainer/export.py); None when missing.
    """

    export_gates: tuple[Gate, ...]
    exports: dict[str, Any] | None


@dataclasses.dataclass(frozen=True)
class BaselineOrigin(Record):
    """report.json `baseline`: the setting `baseline` (`policy`), the baseline's `key` and `url` (None: skipped),
    the run that trained it (`trained_by_run`, from its key record) and whether this run `reused` it."""

    policy: str
    reused: bool
    key: str | None = None
    url: str | None = None
    trained_by_run: str | None = None


@dataclasses.dataclass(frozen=True)
class Hardware(Record):
    """report.json `hardware`: one sentence on what bounds the scaling (`line`), each model's summary's hardware
    (`distributed`, `baseline`) and the host of the evaluate task (`task_host`)."""

    line: str
    distributed: dict[str, Any] | None = None
    baseline: dict[str, Any] | None = None
    task_host: dict[str, Any] | None = None


@dataclasses.dataclass(frozen=True)
class Segment(Record):
    """One launch of the train task (tasks/report/scaling.py): steps `from_step`+1 to `to_step` (`steps` of them) on
    `num_workers` with `grad_accum_steps`, their measured `tokens_per_s` (None: none timed), why it launched so
    (`reason`), its `hosts`, Airflow's `try_number` and the sentence the report shows (`line`)."""

    from_step: int
    to_step: int
    steps: int
    num_workers: int
    grad_accum_steps: int
    line: str
    tokens_per_s: float | None = None
    reason: str | None = None
    hosts: tuple[str, ...] = ()
    try_number: int | None = None


@dataclasses.dataclass(frozen=True)
class Prediction(Record):
    """The preflight advisor's figures for the worker count that trained, beside the measured (tasks/report/scaling.py).

    Attributes:
        num_workers: the workers of the last segment; predicted_speedup, predicted_efficiency,
            predicted_tokens_per_s: the advisor's; measured_speedup, measured_efficiency: the comparison's;
            speedup_error: (predicted - measured) / measured.
        recommendation: the advisor's sentence; rows: its rows (num_workers, speedup, efficiency, tokens_per_s, ...);
        step_source: where its single-worker step time came from.
    """

    num_workers: int
    predicted_speedup: float | None = None
    predicted_efficiency: float | None = None
    predicted_tokens_per_s: float | None = None
    measured_speedup: float | None = None
    measured_efficiency: float | None = None
    speedup_error: float | None = None
    recommendation: str | None = None
    rows: tuple[dict[str, Any], ...] = ()
    step_source: str | None = None


@dataclasses.dataclass(frozen=True)
class TextSample(Record):
    """One prompt from the validation text and a model's greedy and top-k continuations of it."""

    prompt: str
    greedy: str
    top_k: str


@dataclasses.dataclass(frozen=True)
class ModelSamples(Record):
    """report.json `samples[]`: a model's label (`model`), its sample scores and its continuations."""

    model: str
    samples: tuple[TextSample, ...]
    eval_loss: float | None = None
    nats_per_char: float | None = None
    known_words: dict[str, Any] | None = None


@dataclasses.dataclass(frozen=True)
class ContinuedFrom(Record):
    """report.json `continued_from`: the promoted version the run continued from (`model: promoted[:<name>]`)."""

    name: str | None = None
    version: str | None = None
    url: str | None = None
    model_url: str | None = None
    run_id: str | None = None
    eval_loss: float | None = None


@dataclasses.dataclass(frozen=True)
class PromotedScore(Record):
    """report.json `promoted`: the latest promoted version of `name` when evaluate ran, scored on this run's sample.

    Attributes:
        name, version, url, run_id: the version and the run that produced it.
        recorded_eval_loss, recorded_eval_loss_se, recorded_eval_sample: what its pointer recorded.
        eval_loss, eval_loss_se, eval_sample (its id), perplexity, nats_per_char, known_words, samples: its scores
            on this run's sample (None when not scored: `note` says why); delta_se: the standard error of the
            run's loss minus its, paired over the sample's sequences.
    """

    name: str
    version: str
    url: str
    run_id: str | None = None
    recorded_eval_loss: float | None = None
    recorded_eval_sample: str | None = None
    recorded_eval_loss_se: float | None = None
    eval_loss: float | None = None
    eval_loss_se: float | None = None
    eval_sample: str | None = None
    delta_se: float | None = None
    perplexity: float | None = None
    nats_per_char: float | None = None
    known_words: dict[str, Any] | None = None
    samples: tuple[TextSample, ...] | None = None
    note: str | None = None


@dataclasses.dataclass(frozen=True)
class RunReport(Record):
    """report.json (evaluate's; format_version 1; tasks/report/store.py has its layout).

    Attributes:
        format_version: 1; run_id, run_key: the run; created_at: UTC; num_workers: the workers asked.
        gates_passed: every gate passed; runs, comparison, gates: the models' figures, compared and gated.
        baseline: where the baseline came from; hardware, versions, config: what the run ran on and with.
        dataset_fingerprint: the dataset's; eval_sample: what every model of the run was scored on.
        charts: chart name -> file beside report.json.
        segments, elastic: each launch of train, and whether any had fewer workers than asked.
        prediction: the preflight advisor's scaling beside the measured (None: no advice for these workers).
        warnings: throughput sentences (tasks/report/throughput.py); continued_from: the promoted version the run
            continued from; promoted: the promoted version scored on this run's sample; samples: each model's
            continuations.
    `table` (a row per trained model, `table_rows`) is written from the figures, never read back.
    """

    format_version: int
    run_id: str
    run_key: str
    created_at: str
    num_workers: int
    gates_passed: bool
    runs: Runs
    comparison: Comparison
    gates: tuple[Gate, ...]
    baseline: BaselineOrigin | None = None
    hardware: Hardware | None = None
    versions: dict[str, Any] | None = dataclasses.field(default_factory=dict)
    config: dict[str, Any] = dataclasses.field(default_factory=dict)
    dataset_fingerprint: str | None = None
    eval_sample: EvalSample | None = None
    charts: dict[str, str] = dataclasses.field(default_factory=dict)
    segments: tuple[Segment, ...] = ()
    elastic: bool = False
    prediction: Prediction | None = None
    warnings: tuple[str, ...] = ()
    continued_from: ContinuedFrom | None = None
    promoted: PromotedScore | None = None
    samples: tuple[ModelSamples, ...] = ()

    DERIVED = frozenset({"table"})

    def to_xcom(self) -> dict[str, Any]:
        return {**super().to_xcom(), "table": table_rows(self)}

    def failed_gates(self) -> list[Gate]:
        return [gate for gate in self.gates if not gate.passed]


def table_rows(report: RunReport) -> list[dict[str, str]]:
    """One row per trained model: the baseline first (it is the 1-worker reference), then the distributed run."""
    comparison = report.comparison
    rows = []
    for run in report.runs.trained():
        is_reference = run is report.runs.baseline
        rows.append({
            "run": run.label,
            "workers": str(run.num_workers),
            "train time": fmt(run.train_time_s, ".1f", " s"),
            "eval time": fmt(run.eval_time_s, ".1f", " s"),
            "tokens/s": fmt(run.tokens_per_s, ",.0f"),
            "speedup": "1.00x" if is_reference else fmt(comparison.speedup, ".2f", "x"),
            "efficiency": "100%" if is_reference else fmt(comparison.efficiency, ".0f", "%", scale=100),
            "eval loss": fmt(run.eval_loss, ".4f") + (f" ± {run.eval_loss_se:.4f}" if run.eval_loss_se else ""),
            "perplexity": fmt(run.perplexity, ".2f"),
            "nats/char": fmt(run.nats_per_char, ".3f"),
            "known words": known_words(run.known_words),
        })
    return rows
