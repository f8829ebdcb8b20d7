"""The comparison, pure: each trained model's figures, speedup, scaling efficiency, the gates with their limits, the
hardware line and the report built from them (the evaluate task, tasks/evaluate.py, gathers the inputs and writes it).

The loss-parity gate's limit is its tolerance widened by the sampling error of the delta: both models are scored on
the same sample of the validation split (trainer/eval_sample.py), so the delta's standard error is the paired one
over the sample's sequences (core/eval_result.py), and it is 0 when the whole split is scored.
"""

from __future__ import annotations

import math
import os
import platform
from typing import Protocol

from core.clock import utc_now
from core.config import RunConfig
from core.eval_result import GATE_STANDARD_ERRORS, EvalResult
from core.layout import TrainOutput
from core.summary import TrainSummary
from tasks.report import store as reports
from tasks.report.document import BaselineOrigin, Comparison, EvalSample, Gate, Hardware, RunFigures, RunReport, Runs
from tasks.report.formatting import nats


class PreparedIdentity(Protocol):
    """What the report takes of the prepared run (the tasks' `PreparedRun` is one): read-only, so the report, a floor
    below the tasks, needs no task's record."""

    @property
    def run_id(self) -> str: ...
    @property
    def run_key(self) -> str: ...
    @property
    def dataset_fingerprint(self) -> str: ...
    @property
    def baseline_key(self) -> str: ...
    @property
    def baseline_url(self) -> str: ...


def run_figures(label: str, output: TrainOutput, summary: TrainSummary, evaluation: EvalResult) -> RunFigures:
    """The figures of one trained model, from its summary.json and its evaluation result."""
    return RunFigures(
        label=label, num_workers=summary.num_workers, global_batch_size=summary.global_batch_size,
        steps=summary.steps, tokens_seen=summary.tokens_seen, train_time_s=summary.train_time_s,
        seconds_per_step=summary.seconds_per_step, wall_time_s=summary.wall_time_s,
        tokens_per_s=summary.tokens_per_s, final_loss=summary.final_loss, mfu=summary.mfu,
        gpu_mem_peak_mb=summary.gpu_mem_peak_mb,  # rank 0's; null on CPU and in older summaries
        gpu_mem_reserved_mb=summary.gpu_mem_reserved_mb, memory=summary.memory,
        eval_loss=evaluation.eval_loss, perplexity=evaluation.perplexity,
        nats_per_char=evaluation.nats_per_char,  # None in a baseline evaluation cached before them
        known_words=evaluation.known_words, eval_tokens=evaluation.eval_tokens,
        eval_loss_se=evaluation.eval_loss_se,  # over sequences, of the sample as an estimate of the split
        eval_sample=EvalSample.of(evaluation.sample), eval_time_s=evaluation.eval_time_s,
        output_url=output.url, model_url=output.model, summary_url=output.summary,
        started_at=summary.started_at, finished_at=summary.finished_at, resumed_from_step=summary.resumed_from_step,
        hardware=summary.hardware, versions=summary.versions,
        allreduce=summary.allreduce,  # how its gradients crossed the network (trainer/allreduce.py)
    )


def compare(distributed: RunFigures, baseline: RunFigures | None, tolerance: float,
            delta_se: float | None = None) -> Comparison:
    """speedup = T1/TN, efficiency = speedup/N, delta = lossN - loss1 with its standard error `delta_se`.

    T is the training time per optimizer step (no start-up, no compiling first step): with equal steps it is the
    ratio of the train times, and it stays right when a job resumed from a checkpoint and timed fewer steps.
    """
    if baseline is None:
        return Comparison(speedup=None, efficiency=None, loss_delta=None, loss_delta_se=None, loss_tolerance=tolerance)
    timed = baseline.seconds_per_step is not None and distributed.seconds_per_step
    speedup = baseline.seconds_per_step / distributed.seconds_per_step if timed else None
    return Comparison(
        speedup=speedup,
        efficiency=speedup / distributed.num_workers if speedup is not None else None,
        loss_delta=distributed.eval_loss - baseline.eval_loss,
        loss_delta_se=delta_se,
        loss_tolerance=tolerance,
    )


def gates(distributed: RunFigures, baseline: RunFigures | None, comparison: Comparison) -> list[Gate]:
    """Each gate: name, passed, value, limit and a sentence with the numbers (used in the failure message)."""
    finite = math.isfinite(distributed.eval_loss)
    result = [Gate(name="eval_loss_finite", passed=finite, value=distributed.eval_loss, limit=None,
                   detail=f"distributed eval loss is {distributed.eval_loss:.4f}"
                    + ("" if finite else ": training diverged; lower 'learning_rate' or enable warmup"))]
    if baseline is None:
        return result
    same_work = (baseline.steps, baseline.global_batch_size) == (distributed.steps, distributed.global_batch_size)
    result.append(Gate(
        name="same_work", passed=same_work, value=None, limit=None,
        detail=f"baseline trained {baseline.steps} steps of {baseline.global_batch_size} sequences, distributed "
        f"{distributed.steps} of {distributed.global_batch_size}"
        + ("" if same_work else ": the comparison is void; trigger with baseline='run'"),
    ))
    delta, tolerance = comparison.loss_delta, comparison.loss_tolerance
    error = comparison.loss_delta_se or 0.0
    limit = tolerance + GATE_STANDARD_ERRORS * error
    parity = math.isfinite(delta) and abs(delta) <= limit
    result.append(Gate(
        name="loss_parity", passed=bool(parity), value=delta, limit=limit,
        detail=f"eval loss distributed {distributed.eval_loss:.4f} - baseline {baseline.eval_loss:.4f} = "
        f"{nats(delta)} nats, {sampling_allowance(tolerance, error, distributed, baseline)}"
        + ("" if parity else " (setting 'loss_tolerance')"),
    ))
    return result


def sampling_allowance(tolerance: float, error: float, first: RunFigures, second: RunFigures) -> str:
    """How the loss gate's limit follows from its tolerance and the standard error of the delta, in words."""
    sample, other = first.eval_sample or EvalSample(), second.eval_sample or EvalSample()
    if not error:
        exact = "the whole validation split: no sampling error" if sample.whole_split else "no sampling error known"
        return f"tolerance ±{tolerance:.4f} ({exact})"
    how = ("both models scored the same sequences: paired" if sample.id and sample.id == other.id
           else "different samples: their errors combined")
    return (f"limit ±{tolerance + GATE_STANDARD_ERRORS * error:.4f} = tolerance {tolerance:.4f} + "
            f"{GATE_STANDARD_ERRORS:g} x {error:.4f}, the standard error of the delta over "
            f"{'?' if sample.sequences is None else sample.sequences} sampled sequences"
            f" ({how}); a model within tolerance fails by the "
            "sample's chance alone less than 1 time in 40")


# ---------------------------------------------------------------------------------------------------------------
# the report


def hardware_line(cfg: RunConfig, distributed: RunFigures) -> str:
    """One honest sentence on what bounds the scaling of this run."""
    hardware = distributed.hardware or {}
    workers = cfg.num_workers
    if cfg.use_gpu:
        return (f"{workers} workers x 1 GPU ({hardware.get('gpu') or 'GPU'}), chief on {hardware.get('host')}; "
                f"the baseline trained on 1 GPU of the same kind.")
    cores = hardware.get("cpu_count") or os.cpu_count() or 1
    cpu = f" ({hardware['cpu']})" if hardware.get("cpu") else ""
    if workers == 1:
        return f"1 worker on a {cores}-core CPU{cpu}."
    return (
        f"{workers} workers on a {cores}-core CPU: efficiency is bounded by cores. The 1-worker baseline already "
        f"kept all {cores} cores busy, so the {workers} workers split the same cores: expect a speedup near 1x at "
        f"best and efficiency near 1/N = {1 / workers:.0%}, less the cost of the gradient all-reduce. CPU{cpu}."
    )


def build_report(prepared: PreparedIdentity, cfg: RunConfig, *, distributed: RunFigures, baseline: RunFigures | None,
                 delta_se: float | None = None, trained_by: str | None = None) -> RunReport:
    """report.json's core (tasks/report/store.py has its layout): the runs' figures compared and gated; `trained_by`
    is the run that trained the baseline (its key record's), so a reused baseline is reported as such."""
    comparison = compare(distributed, baseline, cfg.loss_tolerance, delta_se)
    checked = gates(distributed, baseline, comparison)
    return RunReport(
        format_version=reports.REPORT_FORMAT_VERSION,
        run_id=prepared.run_id,
        run_key=prepared.run_key,
        created_at=utc_now(),
        num_workers=cfg.num_workers,
        gates_passed=all(gate.passed for gate in checked),
        runs=Runs(distributed=distributed, baseline=baseline),
        comparison=comparison,
        gates=tuple(checked),
        baseline=BaselineOrigin(
            policy=cfg.baseline,
            key=prepared.baseline_key if baseline else None,
            url=prepared.baseline_url if baseline else None,
            trained_by_run=trained_by,
            reused=bool(baseline) and trained_by != prepared.run_id,
        ),
        hardware=Hardware(
            line=hardware_line(cfg, distributed),
            distributed=distributed.hardware,
            baseline=baseline.hardware if baseline else None,
            task_host={"host": platform.node(), "cpu_count": os.cpu_count(), "platform": platform.platform()},
        ),
        versions=distributed.versions,
        config=cfg.to_dict(),
        dataset_fingerprint=prepared.dataset_fingerprint,
        eval_sample=distributed.eval_sample,  # every model of the run scored this one
        charts={"loss_curves": reports.LOSS_CHART, "scaling": reports.SCALING_CHART},
    )
