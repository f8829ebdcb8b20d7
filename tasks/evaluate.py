"""The evaluate task: every model of the run on the same evaluation sample, then the report (tasks/report/comparison.py
compares them: speedup, efficiency, loss parity and the gates).

Each model's evaluation runs `python -m trainer.evaluate` as a group of the run's `num_workers` through the launcher,
on the run's backend (local processes, SSH hosts, pods), so TensorFlow never loads into the Airflow task runner and
release ends it like any worker. Every worker scores its part of the sample (`eval_tokens` validation tokens, the
same for every model: trainer/eval_sample.py); this task combines the parts exactly (core/eval_result.py). The
report is written whatever the outcome of the gates; a failed gate then fails the task with the numbers in the
message.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from core.config import ConfigError
from core.document import DocumentError
from core.eval_result import EvalPart, EvalResult, ResultError, combine, delta_standard_error, part_url
from core.layout import PROMOTION_JSON, RunLayout, StorageLayout, TrainOutput
from core.storage import exists, join, read_bytes, read_json, remove_tree, write_json_atomic
from core.summary import TrainSummary
from tasks import registry, telemetry
from tasks.alerts import alert_throughput
from tasks.baseline import read_key_record
from tasks.checked_run import CheckedRun, Evaluation, OwnRun, checked_run
from tasks.connections import uses_run_storage
from tasks.launch import release_after_exit
from tasks.legacy_models import convert_legacy_model
from tasks.policy import check_launch_urls
from tasks.report import store as reports
from tasks.report import throughput
from tasks.report.charts import loss_chart, scaling_chart
from tasks.report.comparison import build_report, run_figures
from tasks.report.document import ContinuedFrom, ModelSamples, PromotedScore, RunReport, TextSample, table_rows
from tasks.results import Evaluated
from trainer.data import tokenizer_url
from trainer.decoders.architectures import CheckpointError
from trainer.eval_sample import sample_identity

if TYPE_CHECKING:
    from launcher.backend import BackendFactory
    from tasks.prepared_run import PreparedRun

log = logging.getLogger("gpt_finetune.evaluate")

EVALUATE_MODULE = "trainer.evaluate"  # the worker entry point of docs/CONTRACTS.md


class GateFailure(RuntimeError):
    """The distributed model or run failed a comparison gate; the report was still written."""


class EvaluationError(RuntimeError):
    """`trainer.evaluate` exited with an error or wrote no result."""


@uses_run_storage
def evaluate_run(prepared: PreparedRun, own: OwnRun, make_backend: BackendFactory) -> Evaluated:
    """The evaluate task of DAG run `own`; `make_backend` builds the run's backend for each evaluation (the DAG task
    hands in `tf_multiworker.backends.make_backend`). Its steps: the run's URLs derived and the XCom's checked
    against them (tasks/checked_run.py), the models scored, the report assembled and written, the run's throughput
    announced, the gates checked (a failed gate fails the task, the report written)."""
    checked = checked_run(prepared, own)
    cfg = checked.cfg
    scored = score_models(checked, make_backend)
    report = assemble_report(prepared, checked, scored)
    earlier = reports.earlier_reports(checked.storage.runs, exclude_run_key=checked.key)
    expected = throughput.assess(report, earlier, cfg.monitoring.min_throughput_ratio)
    report = replace(report, warnings=tuple(expected.warnings))
    report_json_url = reports.write_report(checked.run.report, report, charts(checked, report, earlier))
    log.info("Report written to %s (report.md follows from the release task)\n%s\n%s", report_json_url,
             reports.text_table(table_rows(report)), f"Hardware: {report.hardware.line if report.hardware else None}")
    announce(checked, report, expected.ratio)
    check_gates(checked.run_id, report, report_json_url)
    comparison = report.comparison
    return Evaluated(report_json_url=report_json_url, speedup=comparison.speedup, efficiency=comparison.efficiency,
                     eval_loss=report.runs.distributed.eval_loss,
                     baseline_eval_loss=scored.baseline_eval.eval_loss if scored.baseline_eval else None,
                     gates_passed=True)


@dataclass(frozen=True)
class Scored:
    """What `score_models` measured: each trained model's output, summary and evaluation, and the promoted
    version's section (None: nothing promoted to compare with)."""

    distributed: TrainOutput
    distributed_summary: TrainSummary
    distributed_eval: EvalResult
    baseline: TrainOutput | None
    baseline_summary: TrainSummary | None
    baseline_eval: EvalResult | None
    promoted: PromotedScore | None


def score_models(checked: CheckedRun, make_backend: BackendFactory) -> Scored:
    """Every model of the run on the same evaluation sample: the distributed one, the baseline (its cached
    evaluation when it scored this sample) and the promoted version. An earlier attempt's report is removed first."""
    cfg = checked.cfg
    distributed = checked.train
    baseline = None if cfg.baseline == "skip" else checked.baseline
    # Fail fast, before any model loads, when a training job left no summary (it did not complete).
    distributed_summary = _read_summary(distributed, "train")
    baseline_summary = _read_summary(baseline, "baseline") if baseline else None

    report_url = checked.run.report
    for stale in (reports.REPORT_JSON, reports.REPORT_MD, reports.LOSS_CHART, reports.SCALING_CHART, PROMOTION_JSON):
        # An earlier attempt's report (or the verdict on it, or its report.md, which release renders again from
        # the new parts) must not pass for this one's.
        remove_tree(join(report_url, stale))
    distributed_eval = run_evaluation(
        checked.evaluation(distributed.model, join(report_url, "eval-distributed.json"), "distributed"), make_backend)
    baseline_eval = evaluate_baseline(checked, baseline, make_backend) if baseline else None
    promoted = evaluate_promoted(checked, make_backend, distributed_eval)
    return Scored(distributed, distributed_summary, distributed_eval, baseline, baseline_summary, baseline_eval,
                  promoted)


def with_release_after_train(report: RunReport, run: RunLayout) -> RunReport:
    """The report with each trained model's `release_after_train_s`, from its group's state record (train, baseline;
    a baseline reused from another run has none here)."""
    runs = report.runs
    baseline = runs.baseline and replace(runs.baseline, release_after_train_s=release_after_exit(run, "baseline"))
    distributed = replace(runs.distributed, release_after_train_s=release_after_exit(run, "train"))
    return replace(report, runs=replace(runs, distributed=distributed, baseline=baseline))


def assemble_report(prepared: PreparedRun, checked: CheckedRun, scored: Scored) -> RunReport:
    """report.json without its warnings: the comparison (tasks/report/comparison.py), the scaling segments and
    prediction, the slots' release after training, where the model continued from, the promoted version and the samples.
    `prepared`'s URLs are `checked`'s (tasks/checked_run.py)."""
    baseline = scored.baseline
    record = read_key_record(baseline.url) if baseline else None
    report = build_report(
        prepared, checked.cfg,
        distributed=run_figures("distributed", scored.distributed, scored.distributed_summary,
                                scored.distributed_eval),
        baseline=run_figures("baseline", baseline, scored.baseline_summary, scored.baseline_eval) if baseline else None,
        delta_se=delta_standard_error(scored.distributed_eval, scored.baseline_eval),
        trained_by=record.trained_by_run if record else None,
    )
    run = checked.run
    report = with_release_after_train(with_scaling(report, run, scored.distributed), run)
    continued = prepared.continued_from
    evaluations: dict[str, EvalResult | PromotedScore | None] = {
        "baseline": scored.baseline_eval, "distributed": scored.distributed_eval}
    if scored.promoted:
        evaluations[f"promoted {scored.promoted.version}"] = scored.promoted
    return replace(report, promoted=scored.promoted, samples=samples_by_model(evaluations),
                   continued_from=None if continued is None else ContinuedFrom.from_json(
                       continued.to_xcom(), "the prepared run", "continued_from"))


def charts(checked: CheckedRun, report: RunReport, earlier: list[RunReport]) -> dict[str, bytes]:
    """The loss curves of the models trained and the scaling history with this run (and the advisor's rows)."""
    trained = report.runs.trained()
    return {
        reports.LOSS_CHART: loss_chart(
            {run.label: read_metrics(TrainOutput(run.output_url)) for run in trained},
            title=f"Training loss and final eval loss, global batch {checked.cfg.global_batch_size}",
            eval_points={run.label: (run.tokens_seen, run.eval_loss) for run in trained},
        ),
        reports.SCALING_CHART: scaling_chart(
            [point for other in earlier for point in reports.history_point(other)] + reports.history_point(report),
            current_run_id=checked.run_id,
            predicted=list(report.prediction.rows) if report.prediction else None,
        ),
    }


def announce(checked: CheckedRun, report: RunReport, ratio: float | None) -> None:
    """The report's metrics, and its throughput warnings as log lines, a count and an alert."""
    telemetry.emit_report_metrics(report, ratio)
    for warning in report.warnings:
        log.warning("Throughput: %s", warning)
    if report.warnings:
        telemetry.count("throughput_warning", {"run": checked.key, "task": "evaluate"})
        alert_throughput(checked.cfg, checked.run_id, list(report.warnings))


def check_gates(run_id: str, report: RunReport, report_json_url: str) -> None:
    """GateFailure, with each failed gate's numbers, when any gate failed (the report is written by then)."""
    failed = report.failed_gates()
    if failed:
        raise GateFailure(
            f"{len(failed)} comparison gate(s) failed for run {run_id} (report: {report_json_url}): "
            + "; ".join(gate.detail for gate in failed)
        )


# ---------------------------------------------------------------------------------------------------------------
# inputs


def _read_summary(output: TrainOutput, task_id: str) -> TrainSummary:
    if not exists(output.summary):
        raise FileNotFoundError(
            f"{output.summary} does not exist: the '{task_id}' task did not complete, so there is nothing to "
            f"compare. Check that task's log; for the baseline, trigger with baseline='run' to train it afresh."
        )
    return TrainSummary.from_json(read_json(output.summary), output.summary)


def read_metrics(output: TrainOutput, rank: int = 0) -> list[dict[str, Any]]:
    """The chief's metrics lines (the loss it logs is the global batch's); empty when it wrote none."""
    url = output.metrics_file(rank)
    if not exists(url):
        log.warning("No metrics at %s: the loss chart will lack this run.", url)
        return []
    return [json.loads(line) for line in read_bytes(url).decode("utf-8").splitlines() if line.strip()]


def run_evaluation(job: Evaluation, make_backend: BackendFactory) -> EvalResult:
    """`python -m trainer.evaluate` as a group of the run's `num_workers` on its backend, each worker scoring its
    part of the `eval_tokens` sample; their output streams to this log. Returns the combined result, also written
    at the job's `output_url`.

    The same launch path as training (tasks/launch.py): the run's marker (release finds it), a state record and the
    ranks' logs in the run's storage (`evaluate-<label>`), its storage URLs held to the run's layout first
    (`tasks.policy.check_launch_urls`: nothing is removed or launched otherwise), storage credentials as secrets
    only, one GPU per worker with `use_gpu` (none otherwise), the start-up and hang bounds of the run. A worker that
    fails fails the evaluation, naming its rank. Held without progress past `max_idle_held_s` it warns as training
    does (mailed when the job's `run_id` is given), and past `reclaim_idle_after_s` it is stopped and the evaluation
    fails, saying so."""
    from core.protocol import MANIFEST_SHA256_ENV
    from launcher import GroupSpec
    from tasks.connections import storage_env
    from tasks.launch import IdleSettings, RecordedLaunch

    cfg, model_url, output_url, label, run_key = job.cfg, job.model_url, job.output_url, job.label, job.run_key
    workers = cfg.num_workers
    spec = GroupSpec(
        name=f"evaluate-{label}", entrypoint=EVALUATE_MODULE, num_workers=workers, use_gpu=cfg.use_gpu,
        run_key=run_key, args=("--model", model_url, "--manifest", job.manifest_url, "--output", output_url,
                               "--eval-tokens", str(cfg.eval_tokens)),
        secret_env=storage_env(cfg.storage_conn_id), startup_timeout_s=cfg.launch.startup_timeout_s,
        hang_timeout_s=cfg.launch.hang_timeout_s,
        # The dataset pinned as the operators pin it on theirs: the workers refuse a manifest of another digest.
        env={MANIFEST_SHA256_ENV: job.manifest_sha256} if job.manifest_sha256 else {},
    )
    try:  # an evaluation reads and writes only the run's own layout (the operator's launches are held alike)
        check_launch_urls(spec.args, cfg.storage_root, run_key)
    except ConfigError as error:
        raise EvaluationError(f"evaluate-{label} launches no workers: {error}") from error
    parts = [part_url(output_url, rank, workers) for rank in range(workers)]
    for stale in {output_url, *parts}:
        remove_tree(stale)  # a result left by an earlier attempt must not pass for this one
    log.info("Evaluating %s on %d worker(s) of backend %s", model_url, workers, cfg.launch.backend)
    backend = make_backend(cfg)
    try:
        launch = RecordedLaunch(spec, backend, StorageLayout(cfg.storage_root).run(run_key),
                                on_line=lambda rank, line: log.info("[evaluate %s %d] %s", label, rank, line),
                                idle=IdleSettings.of(cfg, job.run_id, spec.name))
        result = launch.run_group()
    finally:
        backend.close()
    if launch.reclaimed is not None:
        raise EvaluationError(f"evaluating {model_url} on {workers} worker(s): {launch.reclaimed.text}")
    if not result.succeeded:
        raise EvaluationError(f"evaluating {model_url} on {workers} worker(s) failed: {result.error_message()}")
    evaluation = _combined(parts, output_url, model_url)
    sample = evaluation.sample or {}
    log.info("Evaluated %s on %d worker(s) in %.1f s: eval loss %.4f ± %s, perplexity %.2f, over %s of %s validation "
             "tokens (sample %s)", model_url, workers, result.wall_time_s, evaluation.eval_loss,
             fmt_se(evaluation.eval_loss_se), evaluation.perplexity, sample.get("tokens"), sample.get("split_tokens"),
             evaluation.sample_id)
    return evaluation


def _combined(parts: list[str], output_url: str, model_url: str) -> EvalResult:
    """The result at `output_url`: a single worker's own, or the parts combined (then written there), checked."""
    missing = [url for url in parts if not exists(url)]
    if missing:
        raise EvaluationError(f"{EVALUATE_MODULE} exited 0 but wrote no result at {', '.join(missing)} (model "
                              f"{model_url}).")
    try:
        if parts == [output_url]:
            return EvalResult.from_json(read_json(output_url), output_url)
        result = combine([EvalPart.from_json(read_json(url), url) for url in parts])
    except (ResultError, DocumentError) as error:
        raise EvaluationError(f"evaluating {model_url}: {error}") from error
    write_json_atomic(output_url, result.to_json())
    for url in parts:
        remove_tree(url)
    return result


def fmt_se(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.4f}"


def evaluate_baseline(checked: CheckedRun, baseline: TrainOutput, make_backend: BackendFactory) -> EvalResult:
    """The baseline's evaluation, cached beside it: reused when it scored this run's sample (the baseline key
    holds the sample's identity, so a reused baseline's cache normally has), else evaluated again (also when the
    cache is not a result: it is only a cache)."""
    cfg, cached = checked.cfg, baseline.evaluation
    expected = sample_identity(read_json(checked.manifest_url), cfg.eval_tokens)["id"]
    if exists(cached):
        try:
            evaluation = EvalResult.from_json(read_json(cached), cached)
        except ResultError as error:
            log.warning("Baseline evaluation at %s is not a result (%s): evaluating it again.", cached, error)
        else:
            if evaluation.sample_id == expected:
                log.info("Baseline evaluation reused from %s (same baseline key: same data, sample and code).",
                         cached)
                return evaluation
            log.info("Baseline evaluation at %s scored sample %s, not this run's %s: evaluating it again.", cached,
                     evaluation.sample_id, expected)
    return run_evaluation(checked.evaluation(baseline.model, cached, "baseline"), make_backend)


def with_scaling(report: RunReport, layout: RunLayout, distributed: TrainOutput) -> RunReport:
    """The train task's segments (elastic recovery) and the advisor's prediction next to the measured figures."""
    from tasks.report import scaling

    run = report.runs.distributed
    segments = tuple(scaling.segments(scaling.read_segments(distributed), read_metrics(distributed), run.steps))
    elastic = scaling.is_elastic(segments, report.num_workers)
    preflight = layout.preflight.result
    prediction = scaling.prediction(read_json(preflight) if exists(preflight) else None, run.num_workers,
                                    report.comparison)
    for row in segments if elastic else ():
        log.info("segment: steps %d-%d on %d workers x %d accumulation: %s", row.from_step + 1, row.to_step,
                 row.num_workers, row.grad_accum_steps, row.line)
    return replace(report, segments=segments, elastic=elastic, prediction=prediction)


def evaluate_promoted(checked: CheckedRun, make_backend: BackendFactory,
                      distributed_eval: EvalResult) -> PromotedScore | None:
    """The latest promoted version of `model_name`, scored on this run's evaluation sample (the promotion rule's
    reference and its samples) when its tokenizer is this run's, with the standard error of the run's loss minus
    its (`delta_se`, paired over the sample's sequences); None when nothing is promoted yet or the run is never to
    be promoted (`promote` = never: nothing to compare with). The version's model is the one in its own folder:
    the registry refuses a pointer that names another (tasks/registry.py)."""
    cfg = checked.cfg
    layout = checked.storage.model(cfg.promotion.model_name)
    pointer = registry.read_latest(layout)
    if pointer is None or cfg.promotion.promote == "never":
        return None
    model_url = layout.version(pointer.number).model
    section = PromotedScore(name=cfg.promotion.model_name, version=pointer.version, url=pointer.url,
                            run_id=pointer.run_id, recorded_eval_loss=pointer.eval_loss,
                            recorded_eval_sample=pointer.eval_sample, recorded_eval_loss_se=pointer.eval_loss_se)
    manifest_url = checked.manifest_url
    if not registry.same_tokenizer(model_url, tokenizer_url(manifest_url, read_json(manifest_url))):
        section = replace(section, note=f"{pointer.version}'s tokenizer differs from this run's: it cannot be "
                                        "scored on its shards")
        log.warning("Promoted %s %s not evaluated: %s.", cfg.promotion.model_name, pointer.version, section.note)
        return section
    try:  # a version promoted as tf_model.h5 is scored as its converted checkpoint
        convert_legacy_model(model_url, f"promoted {cfg.promotion.model_name} {pointer.version}")
    except CheckpointError as error:
        section = replace(section, note=f"{pointer.version} cannot be scored: {error}")
        log.warning("Promoted %s %s not evaluated: %s", cfg.promotion.model_name, pointer.version, error)
        return section
    output_url = join(checked.run.report, "eval-promoted.json")
    result = run_evaluation(checked.evaluation(model_url, output_url, "promoted"), make_backend)
    return replace(section, eval_loss=result.eval_loss, perplexity=result.perplexity,
                   samples=text_samples(result.samples, output_url),
                   nats_per_char=result.nats_per_char, known_words=result.known_words,
                   eval_loss_se=result.eval_loss_se, eval_sample=result.sample_id,
                   delta_se=delta_standard_error(distributed_eval, result))


def text_samples(samples: Any, source: str) -> tuple[TextSample, ...] | None:
    """An evaluation's `samples` (None when it generated none)."""
    if not samples:
        return None
    return tuple(TextSample.from_json(sample, source, f"samples[{index}]") for index, sample in enumerate(samples))


def samples_by_model(evaluations: dict[str, EvalResult | PromotedScore | None]) -> tuple[ModelSamples, ...]:
    """Each model's sample scores and continuations (report.json `samples`), for every evaluation that generated
    some: label -> its evaluation result, or the promoted version's scores."""
    section = []
    for label, evaluation in evaluations.items():
        if evaluation is None:
            continue
        samples = evaluation.samples if isinstance(evaluation, PromotedScore) else text_samples(
            evaluation.samples, f"the {label} evaluation")
        if samples:
            section.append(ModelSamples(model=label, samples=samples, eval_loss=evaluation.eval_loss,
                                        nats_per_char=evaluation.nats_per_char, known_words=evaluation.known_words))
    return tuple(section)
